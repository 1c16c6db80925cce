"""`train()`: one readable training loop (not HF Trainer).

    for each optimizer step:
        take grad_accum batches from the stream          # the data of this step, fixed before any compute
        for each micro-batch of them: forward, backward  # loss = sum over tokens / tokens of the whole step
        clip, optimizer step, schedule step
        log a metrics.jsonl line; evaluate when due; checkpoint every save_every steps, every
            save_every_minutes, and at the end
    on CUDA out of memory: free the step, re-plan (halve the micro-batch, then checkpoint activations),
        retry the same step with the same data
    on Ctrl-C: write a checkpoint of the last finished step, exit cleanly (_GracefulStop: twice waits, thrice aborts)

The run holds its output_dir (outdir.py: lock, run identity, no write through a link) from start to end.
On several GPUs each torchrun rank runs this same loop; where ranks differ is behind the named hooks of
_parallel_steps.py (`RankHooks`), each a no-op on one GPU.

Dividing the summed token losses by the step's trained-token count (`num_items_in_batch`) makes the gradient
independent of how the step's data is split into micro-batches: the OOM guard's re-plan changes memory, not
the result.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from .. import data as data_mod
from ..config import position_warning
from ..data.stream import StreamingBatches
from ..errors import FituneError
from ..parallel import ranks
from ..parallel.checkpoint import full_state_dict, save_on_ranks
from ..parallel.data import rank_micro_batches
from ..parallel.deepspeed_engine import release
from ..parallel.ranks import mean
from ..runtime import optim  # optim.build_optimizer: looked up when called (tests wrap it)
from ..runtime import needs  # needs.eval_setting, needs.run_budget_bytes
from ..runtime.device import (CAP_MODE_ENV, ballast_held_bytes, configure_allocator, cpu_training_notice,
                              limit_allocator, outside_allocator_bytes, pick_device, release_memory)
from ..runtime.oom import is_oom
from ..specs.gpu import resolve_gpu
from ..units import GiB
from . import checkpoint, identity, outdir
from .config import TrainConfig
from .loggers import make_loggers
from .progress import progress_bar

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """How a step is executed; the OOM guard changes it, the data and the optimizer never notice."""

    micro_batch_size: int
    grad_checkpointing: bool
    changes: list[dict] = field(default_factory=list)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    eval_losses: dict[int, float]
    output_dir: str
    adapter_dir: str | None
    merged_dir: str | None
    plan: Plan
    model: object = None
    """The trained model (in memory), for callers that go on using it."""


class TrainingInterrupted(FituneError):
    exit_code = 130


def train(cfg: TrainConfig, resume: bool = False, fault=None, progress: bool = True,
          overwrite: bool = False, allow_changed: bool = False) -> TrainResult:
    """Run the training `cfg` describes, in an output_dir this run holds (locked) until it returns.

    Args:
        resume: continue the run in output_dir from its newest complete checkpoint; each config change since
            that checkpoint is applied or refused by name (`checkpoint.RESUME_APPLIES`).
        fault: `fault(step, micro_index)` may raise to inject failures (tests).
        overwrite: a fresh run in a used output_dir first moves the old contents to `output_dir.old-<time>`.
        allow_changed: resume although the base weights or the data files changed since the run started (said);
            without it such a resume is refused by name (identity.py).

    Raises:
        OutputDirError, ConfigError, CheckpointError: exit 2, the message says what to do.
        TrainingInterrupted: Ctrl-C (exit 130), after the checkpoint of the last finished step is written.
    """
    main = ranks.start(cfg.setup.num_gpus, cfg.setup.strategy).is_main  # [parallel] torchrun's ranks join here
    if main:
        warning = position_warning(cfg)  # seq_len beyond the model's positions: allowed, said before anything loads
        if warning:
            log.warning("fitune train: warning: %s", warning)
    folder = None
    try:
        # [parallel] rank 0 alone opens (locks) output_dir and writes in it; the other ranks follow it
        now = identity.fingerprint(cfg.model, cfg.data.path) if main else None  # hashes of weights and data
        folder = ranks.share_folder(outdir.open_run(cfg.output_dir, cfg.to_dict(), resume=resume, overwrite=overwrite,
                                                    identity=now) if main else None)
        if main:
            checkpoint.remove_partial(folder)  # .tmp folders of a write cut short: never complete, never resumed
            for note in identity.check(folder.identity, now, allow_changed) if resume else []:
                print(f"fitune: {note}", file=sys.stderr)
        resume_from = ranks.broadcast(_resume_point(cfg, folder) if resume and main else None)
        return _train(cfg, folder, resume_from, fault, progress)
    except BaseException:
        if main and folder is not None and not resume:
            folder.forget_if_nothing_trained()  # bad data or model: the same command may simply start again
        raise
    finally:
        if folder is not None:
            folder.close()
        _GracefulStop.restore_all()  # after the lock's release: a late second Ctrl-C cannot cut it short
        ranks.stop()
        release()  # [parallel] ZeRO: the engine and the ZeRO-3 construction config end with the run


def _resume_point(cfg: TrainConfig, folder: outdir.RunFolder) -> str:
    """The run's newest complete checkpoint, once every config change since it is applied or refused."""
    path, state, skipped = checkpoint.newest_verified(folder.root, folder.run_id)  # links, sizes, SHA-256
    if path is None:
        raise FituneError(f"--resume: run {folder.run_id} in {cfg.output_dir} has no complete checkpoint yet; "
                          "start it again with --overwrite")
    if skipped:  # said aloud: resuming from an older step than the newest folder trains those steps again
        print(f"fitune: --resume: {'; '.join(skipped)}; resuming from {os.path.basename(path)}", file=sys.stderr)
    if cfg.max_steps is not None and cfg.max_steps < state["step"]:
        raise FituneError(f"--resume: max_steps {cfg.max_steps} is below the checkpoint's step {state['step']} "
                          f"({path}); give max_steps >= {state['step']} to continue, or start a new run with "
                          "--overwrite")
    saved = state.get("config") or {}
    changes = checkpoint.check_config_changes(checkpoint.flat_config(saved), checkpoint.flat_config(cfg.to_dict()))
    for change in changes:  # said aloud: a resumed run that silently ignored --lr was the bug
        print(f"fitune: {change}", file=sys.stderr)
    return path


def _train(cfg: TrainConfig, folder: outdir.RunFolder, resume_from: str | None, fault, progress: bool) -> TrainResult:
    """The run itself, in `folder` (held by `train`); from the checkpoint `resume_from` when given."""
    # torch, numpy, transformers: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    import torch

    from ..runtime.model import load_tokenizer
    from ._parallel_steps import RankHooks

    par = RankHooks()  # [parallel] where torchrun's ranks meet; on one GPU each hook is a no-op
    device = _start_device(cfg, par)
    _seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)
    s = cfg.setup
    stream, eval_items, total_steps = _load_data(cfg, tokenizer, par.global_batch_rows(s.batch_size))
    model, engine = _load_model(cfg, tokenizer, device, par)
    trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP2: the shards
    optimizer = optim.build_optimizer(s.optimizer, trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = _scheduler(cfg, optimizer, total_steps)
    optimizer = par.attach_optimizer(engine, optimizer, s, cfg)  # [parallel] ZeRO: DeepSpeed steps it
    scaler = torch.amp.GradScaler("cuda") if s.dtype == "fp16" and device == "cuda" else None
    plan = Plan(micro_batch_size=s.batch_size, grad_checkpointing=s.grad_checkpointing != "none")
    step = _resume(cfg, resume_from, model, optimizer, scheduler, stream, plan) if resume_from else 0
    eval_rows, eval_loss = _eval_setting(cfg, device, par.is_main) if eval_items is not None else (None, None)
    report = _Report(cfg, folder, step, total_steps, progress and par.is_main, device, par.is_main)
    losses: list[float] = []
    eval_losses: dict[int, float] = {}
    stream_before_step = stream.state_dict()
    stop = _GracefulStop(last_checkpoint=resume_from)
    last_save_s = time.monotonic()  # save_every_minutes counts from here
    try:
        while step < total_steps:
            stream_before_step = stream.state_dict()  # an interrupted step's data is taken again on resume
            batches = [stream.next_batch() for _ in range(s.grad_accum)]  # this step's data, fixed
            t0 = time.perf_counter()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()  # per-step peaks in metrics.jsonl
            retries_before = _alloc_retries(device)
            loss = _step_with_oom_guard(cfg, engine.step_model, optimizer, scaler, stream, batches, plan, step, fault,
                                        device, check_gradients=not losses)  # the process's first step
            scheduler.step()
            step += 1
            stream_before_step = stream.state_dict()  # this step is done: its data is consumed
            step_time_s = time.perf_counter() - t0
            losses.append(loss)
            report.step(step, _step_line(step, loss, scheduler, batches, step_time_s, plan, device, scaler,
                                         _alloc_retries(device) - retries_before))
            if eval_items is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == total_steps):
                eval_losses[step] = _evaluate(engine.step_model, eval_items, data_mod.pad_id(tokenizer), cfg, device,
                                              eval_rows, eval_loss)
                report.eval_loss(step, eval_losses[step])
            if _checkpoint_due(cfg, step, total_steps, time.monotonic() - last_save_s):
                _save(cfg, folder, step, model, optimizer, scheduler, stream, plan, stop)
                last_save_s = time.monotonic()
            if par.stop_together(stop.requested):  # [parallel] every rank stops after the same step
                raise KeyboardInterrupt
        # written while Ctrl-C is still handled: a press now lets them finish, a third aborts (checkpoint kept)
        adapter_dir, merged_dir = _write_outputs(cfg, folder, model, tokenizer)
    except KeyboardInterrupt:
        report.bar.close()
        report.metrics.close()
        if step and not stop.aborted:  # after a third Ctrl-C the state may be half-updated: nothing more is written
            stream.load_state_dict(stream_before_step)  # the unfinished step's batches are not consumed
            try:
                _save(cfg, folder, step, model, optimizer, scheduler, stream, plan, stop)
            except KeyboardInterrupt:  # the third Ctrl-C, during this write: its .tmp folder is never resumed
                pass
        raise _interrupted(step, stop) from None
    finally:
        report.close()
    report.bar.close()
    report.metrics.close()
    return TrainResult(step, losses, eval_losses, cfg.output_dir, adapter_dir, merged_dir, plan, model=model)


# ---- before the first step ---------------------------------------------------------------------------------


def _start_device(cfg: TrainConfig, par) -> str:
    """The device this process trains on, its allocator configured (and capped to `cfg.cap`'s budget)."""
    configure_allocator(cfg.setup)  # before CUDA starts
    device = par.device or pick_device()  # [parallel] a rank runs on its own GPU (or CPU)
    if device == "cpu" and par.device is None:  # one process without a GPU (not a rehearsal of several ranks)
        for line in cpu_training_notice(cfg.setup.dtype):
            log.warning("fitune train: %s", line)
    if cfg.cap and device == "cuda":
        limit_allocator(resolve_gpu(str(cfg.cap)).allocator_budget_bytes)  # behave as the smaller card would
        log.info("fitune train: capped at %s: %d bytes outside PyTorch's allocator now (the CUDA context; kernels "
                 "loaded later add to it), %d bytes of ballast", cfg.cap, outside_allocator_bytes(),
                 ballast_held_bytes())
    return device


def _load_data(cfg: TrainConfig, tokenizer, rows: int) -> tuple:
    """(the batch stream of `rows` rows per batch, the eval examples or None, the run's optimizer steps): the data
    tokenised once and batched deterministically, or streamed."""
    s = cfg.setup
    if cfg.data.streaming:  # records read as the steps need them; max_steps counts the run (the config requires it)
        stream = StreamingBatches(cfg.data.path, cfg.data.split, cfg.data.subset, tokenizer, cfg.data.format,
                                  s.seq_len_tokens, rows, data_mod.pad_id(tokenizer), packed=cfg.packing)
        log.info("data: format %s; streaming %s (records read as training needs them, in source order)",
                 stream.format, cfg.data.path)
        items = None
    else:
        records = data_mod.read_records(cfg.data.path, cfg.data.split, cfg.data.subset)
        examples, stats = data_mod.tokenize_records(records, tokenizer, cfg.data.format, s.seq_len_tokens)
        items = data_mod.pack(examples, s.seq_len_tokens) if cfg.packing else examples
        log.info("data: format %s; %s", stats.format, stats.summary())
        if stats.dropped_records:  # records with no token to train on: say which, never drop them silently
            log.warning("fitune train: %s", stats.dropped_message())
        stream = data_mod.BatchStream(items, rows, cfg.seed, data_mod.pad_id(tokenizer), packed=cfg.packing)
    eval_items = None
    if cfg.data.eval_path:
        ev, ev_stats = data_mod.tokenize_records(data_mod.read_records(cfg.data.eval_path), tokenizer,
                                                 cfg.data.format, s.seq_len_tokens)
        if ev_stats.dropped_records:
            log.warning("fitune train: eval data: %s", ev_stats.dropped_message())
        eval_items = data_mod.pack(ev, s.seq_len_tokens) if cfg.packing else ev
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * math.ceil(len(items) / rows) / s.grad_accum))
    return stream, eval_items, total_steps


def _load_model(cfg: TrainConfig, tokenizer, device: str, par) -> tuple:
    """(the model prepared for the setup: LoRA / freeze, fitune's techniques, checkpointing; the engine the step
    runs: `par.wrap`'s DDP / FSDP2 / ZeRO around it, or the model itself)."""
    from ..runtime.model import build_model_for_setup, prepare_model

    s = cfg.setup
    with par.building_model(s, cfg):  # [parallel] ZeRO-3: each parameter partitioned as it is created (zero.Init)
        model = build_model_for_setup(cfg.model, s, device, init=cfg.init, trust_remote_code=cfg.trust_remote_code)
    model.config.use_cache = False  # training: no KV cache
    model = prepare_model(model, s)  # LoRA / freeze, fitune's techniques, checkpointing
    if cfg.packing and cfg.packing_attention == "varlen":
        _packed_attention(model, s.attn)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise FituneError(f"tokenizer {cfg.tokenizer or cfg.model} has {len(tokenizer)} tokens but the model's embedding "
                          f"has {vocab} rows; use the model's own tokenizer")
    return model, par.wrap(model, s)  # [parallel] DDP / FSDP2 / ZeRO around model and loss


def _packed_attention(model, attn: str) -> None:
    """packing_attention varlen: each packed example attends only to itself, as cheaply as the model allows."""
    from ..runtime.techniques.varlen_attention import enable_varlen_attention

    if enable_varlen_attention(model):
        log.info("packing: examples attended one by one inside each row (no mask tensor)")
    elif attn == "flash":  # one row per micro-batch (TrainConfig.validate): its position ids give the bounds
        log.info("packing: flash-attention 2 attends each example on its own (varlen, from the position ids)")
    else:
        log.info("packing: this model keeps transformers' block-diagonal mask (sliding window or attention %s)",
                 attn)


def _resume(cfg: TrainConfig, path: str, model, optimizer, scheduler, stream, plan: Plan) -> int:
    """The checkpoint `path` loaded into model, optimizer, schedule, data stream and plan; returns its step."""
    from ..runtime.model import set_checkpointing

    state = checkpoint.load(path, model, optimizer, scheduler)
    _apply_hyperparameters(cfg, optimizer, scheduler)  # a changed lr / weight_decay takes effect now
    step = state["step"]
    stream.load_state_dict(state["data"])
    for change in state.get("plan_changes", []):  # keep the re-plans that made the run fit
        plan.micro_batch_size = change["micro_batch_size"]
        if change["grad_checkpointing"] and not plan.grad_checkpointing:
            set_checkpointing(model, True)
        plan.grad_checkpointing = change["grad_checkpointing"]
        plan.changes.append(change)
    log.info("resumed from %s at step %d", path, step)
    return step


# ---- after each step -----------------------------------------------------------------------------------------


class _Report:
    """Where each step's numbers go: metrics.jsonl, TensorBoard / W&B (metrics.jsonl's scalars), the progress bar
    (loss, eval loss, peak memory / budget)."""

    def __init__(self, cfg: TrainConfig, folder, step: int, total_steps: int, progress: bool, device: str,
                 is_main: bool):
        # drops the lines of steps after the checkpoint: they are trained again
        self.metrics = folder.open_metrics(through_step=step)
        self.loggers = make_loggers(cfg.report_to, cfg.output_dir, os.path.basename(os.path.normpath(cfg.output_dir)),
                                    cfg.to_dict()) if is_main else []  # [parallel] rank 0 alone logs
        self.bar = progress_bar(total_steps, step, progress, device, cfg.cap, log_every=cfg.log_every)
        self.steps_seen = 0
        self.retries_said = False
        self.fraction_cap = bool(cfg.cap) and os.environ.get(CAP_MODE_ENV) != "ballast"

    def step(self, step: int, line: dict) -> None:
        self.steps_seen += 1
        if line.get("alloc_retries") and self.steps_seen > 1 and not self.retries_said:  # past the first step
            self.retries_said = True
            fraction = getattr(self, "fraction_cap", False)
            outside = line.get("outside_allocator_bytes")
            log.warning("fitune train: step %d: the CUDA allocator freed its cache and retried %d times (see "
                        "`alloc_retries` in metrics.jsonl): the step fits, but each retry costs time; a shorter "
                        "seq_len or micro-batch leaves it room%s%s", step, line["alloc_retries"],
                        "; under `cap:` PyTorch's memory fraction counts each request whole against the cap, so the "
                        f"card's own count can differ ({CAP_MODE_ENV}=ballast simulates the card as it is)"
                        if fraction else "",
                        f"; {outside / GiB:.2f} GiB of the GPU is in use outside PyTorch's allocator (the CUDA "
                        "context, the kernels loaded so far, libraries' state), which the allocator cannot have"
                        if outside and not fraction else "")
        self.metrics.write(json.dumps(line) + "\n")
        self.metrics.flush()
        for logger in self.loggers:
            logger.log(step, line)
        self.bar.update(line)

    def eval_loss(self, step: int, loss: float) -> None:
        self.bar.set_eval_loss(loss)
        self.metrics.write(json.dumps({"step": step, "eval_loss": loss}) + "\n")
        self.metrics.flush()
        for logger in self.loggers:
            logger.log(step, {"eval_loss": loss})

    def close(self) -> None:
        """metrics.jsonl and the loggers (the bar is closed by the loop: before a Ctrl-C's message, or at the end)."""
        self.metrics.close()
        for logger in self.loggers:
            logger.close()


def _alloc_retries(device: str) -> int:
    """How many times the CUDA caching allocator has freed its cache and retried an allocation in this process
    (`num_alloc_retries`, not reset by reset_peak_memory_stats): a step that needs retries runs, but slower."""
    import torch

    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def _step_line(step: int, loss: float, scheduler, batches: list, step_time_s: float, plan: Plan, device: str,
               scaler, alloc_retries: int = 0) -> dict:
    """The step's line of metrics.jsonl."""
    import torch

    tokens = sum(b.tokens for b in batches)
    line = {"step": step, "loss": loss, "lr": scheduler.get_last_lr()[0], "tokens": tokens,
            "trained_tokens": sum(b.trained_tokens for b in batches), "tokens_per_s": tokens / step_time_s,
            "step_time_s": step_time_s, "micro_batch_size": plan.micro_batch_size,
            "grad_checkpointing": plan.grad_checkpointing,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if device == "cuda" else None,
            "alloc_retries": alloc_retries if device == "cuda" else None,
            "outside_allocator_bytes": outside_allocator_bytes() if device == "cuda" else None}
    if scaler is not None:
        line["loss_scale"] = scaler.get_scale()
    return line


def _interrupted(step: int, stop: "_GracefulStop") -> TrainingInterrupted:
    """Said on stderr, and the exception `train` ends with after a Ctrl-C (exit 130)."""
    path = stop.last_checkpoint
    how = "aborted" if stop.aborted else "interrupted"
    print(f"\n{how} at step {step}: "
          + (f"the last complete checkpoint is {path}; continue with --resume" if path else "no checkpoint yet"),
          file=sys.stderr)
    return TrainingInterrupted(f"{how} at step {step}" + (f"; resume from {path}" if path else ""))


# ---- one optimizer step ----------------------------------------------------------------------------------


def _step_with_oom_guard(cfg, model, optimizer, scaler, stream, batches, plan, step, fault, device,
                         check_gradients: bool = False) -> float:
    """Run the step; on an out-of-memory error free it, re-plan and run the same data again. `check_gradients`:
    stop if no trainable parameter got a gradient (`fitune.runtime.step.require_gradients`)."""
    while True:
        try:
            return _optimizer_step(cfg, model, optimizer, scaler, stream, batches, plan, step, fault, check_gradients)
        except Exception as exc:  # noqa: BLE001 - only OOM is handled; anything else propagates
            if not (cfg.oom_guard and is_oom(exc)) or ranks.current().distributed:  # [parallel] a re-plan on one
                raise                                                 # rank alone would leave the others waiting
            optimizer.zero_grad(set_to_none=True)  # partial gradients of the failed attempt go
            del exc
            change = _replan(model, plan, step)
            if change is None:
                raise FituneError(
                    f"out of memory at step {step + 1} even with micro-batch 1 and checkpointing; "
                    "`fitune estimate` with this config shows where the memory goes (shorter seq_len or method: qlora)")
            plan.changes.append(change)
            print(f"\nfitune: out of memory at step {step + 1}: {change['why']}; retrying the step with the same data",
                  file=sys.stderr)
        # Out of the except block: the traceback that held the failed attempt's frames, and through them its
        # activations, is gone only now, so its blocks can go back to the GPU (inside the block they could not:
        # the cache stayed full to the cap, and the re-planned steps ran against it)
        release_memory(device)


def _optimizer_step(cfg, model, optimizer, scaler, stream, batches, plan, step, fault,
                    check_gradients: bool = False) -> float:
    """The step's batches split into the plan's micro-batches, through the runtime's one training step."""
    from ..parallel.wrap import step_loss
    from ..runtime.step import train_step

    # loss = summed token losses / the step's trained tokens; [parallel] this rank's slice of the global batch
    micro, num_items = rank_micro_batches(stream, batches, plan.micro_batch_size)
    stats = train_step(model, optimizer, micro, loss=step_loss(model, cfg.setup.loss), num_items=num_items,
                       scaler=scaler, max_grad_norm=cfg.max_grad_norm, check_gradients=check_gradients,
                       before_micro_batch=None if fault is None else lambda i: fault(step, i))
    if stats.overflowed:
        print(f"\nfitune: fp16 overflow at step {step + 1}; loss scale {stats.loss_scale_before:g} -> "
              f"{stats.loss_scale:g}" + (" (collapsing: use dtype bf16)" if stats.loss_scale < 1 else ""),
              file=sys.stderr)
    return mean(stats.loss)  # [parallel] the mean of the ranks' losses: the loss of the whole global batch


def _replan(model, plan: Plan, step: int) -> dict | None:
    """The next, less memory-hungry way to run a step with the same effective batch."""
    from ..runtime.model import set_checkpointing

    if plan.micro_batch_size > 1:
        old = plan.micro_batch_size
        plan.micro_batch_size = max(1, old // 2)
        why = f"micro-batch {old} -> {plan.micro_batch_size} (more accumulation, same effective batch)"
    elif not plan.grad_checkpointing:
        set_checkpointing(model, True)
        plan.grad_checkpointing = True
        why = "gradient checkpointing turned on"
    else:
        return None
    return {"step": step + 1, "why": why, "micro_batch_size": plan.micro_batch_size,
            "grad_checkpointing": plan.grad_checkpointing}


# ---- pieces --------------------------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def _scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)


def _eval_setting(cfg: TrainConfig, device: str, say: bool) -> tuple[int, str]:
    """Rows per eval forward and the eval loss, chosen to fit the GPU budget the training fits
    (fitune/runtime/needs.py `eval_setting`); said on stderr when they differ from the training step's."""
    rows, loss, line = needs.eval_setting(cfg, needs.run_budget_bytes(cfg, device == "cuda"))
    if line and say:
        print(f"fitune: {line}", file=sys.stderr)
    return rows, loss


def _evaluate(model, items, pad_token_id: int, cfg: TrainConfig, device: str, rows: int | None = None,
              loss_name: str | None = None) -> float:
    """Mean token loss over the eval set (no gradients, so no saved activations), `rows` rows per forward with the
    loss `loss_name` (`_eval_setting`; default: the training micro-batch and loss)."""
    import torch

    from ..parallel.wrap import step_loss
    from ..runtime.step import forward_loss

    rows = rows or cfg.setup.batch_size
    stream = data_mod.BatchStream(items, rows, cfg.seed, pad_token_id, packed=cfg.packing, shuffle=False)
    n_batches = math.ceil(len(items) / rows)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(n_batches):
            b = stream.next_batch()
            loss = forward_loss(model, b, loss=step_loss(model, loss_name or cfg.setup.loss), num_items=1)  # summed
            total += loss.item()
            tokens += b.trained_tokens
    if was_training:
        model.train()
    return total / max(1, tokens)


def _checkpoint_due(cfg: TrainConfig, step: int, total_steps: int, since_save_s: float) -> bool:
    """Every save_every steps, every save_every_minutes of training, and always at the end."""
    return (step == total_steps or bool(cfg.save_every and step % cfg.save_every == 0)
            or bool(cfg.save_every_minutes and since_save_s >= cfg.save_every_minutes * 60))


def _save(cfg, folder, step, model, optimizer, scheduler, stream, plan, stop) -> str:
    stop.saving_step = step  # a Ctrl-C now says it waits for this write
    try:
        path = save_on_ranks(  # [parallel] rank 0 writes; FSDP2: every rank writes its shards first
            lambda writer: checkpoint.save(folder, step, model, optimizer, scheduler, stream.state_dict(),
                                           {"plan_changes": plan.changes, "config": cfg.to_dict()},
                                           keep=cfg.keep_checkpoints, sharded_writer=writer),
            model, optimizer, sharded=cfg.setup.strategy != "ddp", strategy=cfg.setup.strategy)
    finally:
        stop.saving_step = None
    stop.last_checkpoint = path
    return path


def _apply_hyperparameters(cfg: TrainConfig, optimizer, scheduler) -> None:
    """The config's lr and weight_decay, not the checkpoint's, drive the resumed steps: the schedule's base rate is
    replaced and the current rate recomputed at the resumed step, as `scheduler.step()` computes it (LambdaLR:
    base_lr * lambda(step)), so an unchanged lr gives the same float and the losses of an uninterrupted run."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * lr_lambda(scheduler.last_epoch)
        if "weight_decay" in group:
            group["weight_decay"] = cfg.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _write_outputs(cfg: TrainConfig, folder, model, tokenizer) -> tuple[str | None, str | None]:
    """The adapter as a PEFT folder (safetensors), optionally merged weights; full / freeze: the whole model."""
    adapter_dir = merged_dir = None
    if cfg.setup.method in ("lora", "qlora"):
        adapter_dir = _write_pretrained(cfg, folder, "adapter", model, tokenizer)
        if cfg.merge:
            merged_dir = _write_pretrained(cfg, folder, "merged", model.merge_and_unload(), tokenizer)
    else:
        merged_dir = _write_pretrained(cfg, folder, "model", model, tokenizer)
    return adapter_dir, merged_dir


def _write_pretrained(cfg: TrainConfig, folder, name: str, model, tokenizer) -> str:
    """`output_dir/name` written as a fresh `name.tmp/` (no file in it a planted link could redirect), then renamed
    over the old one: a crash leaves the old folder or the new one, complete."""
    state = full_state_dict(model, cfg.setup.strategy)  # [parallel] FSDP2 / ZeRO-3: gathered on rank 0 (else None)
    if not ranks.is_main():  # [parallel] rank 0 alone writes
        return os.path.join(cfg.output_dir, name)
    kwargs = {"state_dict": state} if state is not None else {}
    if name == "adapter":
        # fitune never resizes the vocabulary, so the base's embedding tables are not part of the adapter; PEFT's
        # "auto" would read the base's config.json to decide, and warns when `model:` is a .gguf file or a Hub id
        kwargs["save_embedding_layers"] = False
    with folder.writing(name) as tmp:  # a failed write (a full disk) says what to do; the checkpoints stay
        model.save_pretrained(tmp, safe_serialization=True, **kwargs)
        tokenizer.save_pretrained(tmp)
    return os.path.join(cfg.output_dir, name)


class _GracefulStop:
    """Ctrl-C (or SIGTERM) that never costs the last complete checkpoint.

    1st: the running step finishes (no half-applied optimizer step), a checkpoint is written, the run exits.
    2nd: says what it is waiting for (the step, or the checkpoint being written) and goes on waiting.
    3rd: aborts at once and writes nothing more (the state may be half-updated). A checkpoint cut short stays a
         `.tmp` folder; the previous complete one, which no write touches, is what --resume takes.
    """

    def __init__(self, last_checkpoint: str | None = None):
        self.presses = 0
        self.saving_step: int | None = None
        """The step whose checkpoint is being written, if one is."""
        self.last_checkpoint = last_checkpoint
        """The newest complete checkpoint of this run."""
        self._old: dict = {}
        _GracefulStop._active.append(self)  # restored by `train` once the output folder is released
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.presses >= 1

    @property
    def aborted(self) -> bool:
        return self.presses >= 3

    def _handle(self, signum, frame):
        self.presses += 1
        kept = (f"the last complete checkpoint, {self.last_checkpoint}, stays" if self.last_checkpoint
                else "no checkpoint is complete yet")
        if self.presses == 1:
            _say("finishing this step, then writing a checkpoint (Ctrl-C twice more to abort at once)")
        elif self.presses == 2:
            what = (f"the checkpoint of step {self.saving_step} being written" if self.saving_step is not None
                    else "this step and its checkpoint")
            _say(f"finishing {what} first; Ctrl-C once more aborts ({kept})")
        else:
            _say(f"aborting ({kept})")
            raise KeyboardInterrupt

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    _active: list = []

    @classmethod
    def restore_all(cls):
        while cls._active:
            cls._active.pop().restore()


def _say(message: str) -> None:
    """Print from a signal handler: the handler can run inside another write to stderr, which then refuses."""
    try:
        print(f"\nfitune: {message}", file=sys.stderr, flush=True)
    except RuntimeError:  # reentrant call inside the stderr buffer: the message is lost, the handling is not
        pass
