"""Training on several GPUs through existing engines: DDP, FSDP2, DeepSpeed ZeRO.

    fitune train run.yaml --gpus 4 --strategy fsdp
      `fitune train` (one process)                 launch.py: checks the GPUs, then runs
        python -m torch.distributed.run --standalone --nproc-per-node 4 -m fitune train run.yaml ...
          each rank: fitune.train.loop, the same loop as one GPU, with four hook points
            ranks.py     join the process group (nccl, or gloo without CUDA); rank 0 alone writes
            data         every rank builds the same global batch (batch_size x gpus rows) and trains its slice
            wrap.py      the model and its loss as one module, wrapped by the engine: DistributedDataParallel,
                         fully_shard per decoder layer then the root (FSDP2), or deepspeed.initialize (ZeRO)
            loss         the logged loss is averaged over the ranks: the loss of the whole global batch
            checkpoint.py  FSDP2 / ZeRO: a sharded torch.distributed.checkpoint folder; DDP: rank 0's safetensors

Nothing here imports torch at import; `launch` runs in the parent process before torch starts.
"""

from __future__ import annotations

ZERO_STRATEGIES = ("zero2", "zero3", "zero3_offload")
"""Strategies DeepSpeed runs."""

CPU_RANKS_ENV = "FITUNE_CPU_RANKS"
"""Set to 1 to run --gpus N as N CPU processes over gloo on a machine without CUDA (tests, rehearsals)."""
