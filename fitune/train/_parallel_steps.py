"""The `[parallel]` hooks of the training loop (loop.py `_train`), in one place.

torchrun starts one process per GPU (fitune/parallel/launch.py); each runs loop.py's single-GPU loop and meets the
others only at these hooks. On one GPU without a strategy every hook is a no-op that returns its input (or the
single-GPU value), so the loop calls them unconditionally and reads as the single-GPU loop.

Imported by `_train` only (it imports torch through fitune/parallel/wrap.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from ..parallel import data as parallel_data, ranks, wrap as parallel_wrap
from ..parallel.deepspeed_engine import construction_context


class RankHooks:
    """Where one rank's loop differs from the single-GPU loop: its device, its share of the batch, how the model is
    built and wrapped, who writes, and stopping together."""

    @property
    def device(self) -> str | None:
        """This rank's own GPU ("cuda") or "cpu"; None on one process (the loop picks)."""
        return ranks.current().device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs (metrics, TensorBoard / W&B, the progress bar) and writes."""
        return ranks.is_main()

    def global_batch_rows(self, batch_size: int) -> int:
        """Rows the data stream yields per batch: the global batch, batch_size on each GPU."""
        return parallel_data.global_batch_rows(batch_size)

    def building_model(self, setup, cfg) -> AbstractContextManager:
        """Enter around building the model: ZeRO-3 partitions each parameter as it is created (zero.Init)."""
        return construction_context(setup, cfg)

    def wrap(self, model, setup) -> parallel_wrap.Engine:
        """DDP / FSDP2 / ZeRO around the model and its loss; on one GPU the model itself (`engine.step_model`)."""
        return parallel_wrap.wrap(model, setup, ranks.current())

    def attach_optimizer(self, engine: parallel_wrap.Engine, optimizer, setup, cfg):
        """The optimizer the step steps: `optimizer` itself, or for ZeRO DeepSpeed's engine around it."""
        return parallel_wrap.attach_optimizer(engine, optimizer, setup, cfg)

    def stop_together(self, requested: bool) -> bool:
        """A stop (Ctrl-C) requested on any rank: every rank stops after the same step."""
        return ranks.any_rank(requested)
