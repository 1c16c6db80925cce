"""Each rank's share of a step's data.

Every rank reads the same BatchStream, whose batches are the global batch (batch_size x gpus rows): the stream's
state (epoch, items taken) is the same on every rank and in the checkpoint, and a run resumed on another number
of GPUs continues at the same item. Rank r trains rows [r * per, (r + 1) * per) of each batch, per = ceil(rows /
gpus).

The loss of rank r is its summed token loss / (the global batch's trained tokens / gpus). The engines average the
gradients over the ranks (DDP's all-reduce, FSDP2's reduce-scatter, ZeRO's reduction all divide by gpus), so the
averaged gradient is the gradient of (summed token loss of the whole global batch / its trained tokens): the
gradient one GPU computes on the whole batch. The mean of the ranks' losses is the loss of the whole batch.
"""

from __future__ import annotations

import dataclasses
import math

from .ranks import current


def global_batch_rows(batch_size: int) -> int:
    """Rows the stream yields per batch: batch_size on each of the run's GPUs."""
    return batch_size * current().world_size


def rank_micro_batches(stream, batches: list, micro_batch_size: int) -> tuple[list, float]:
    """This rank's micro-batches of a step's (global) batches, and what its summed token loss is divided by.

    Every rank gets the same number of micro-batches (the engines' collectives run once per micro-batch on every
    rank): a rank whose slice is short or empty gets micro-batches with no trained token (labels all -100), which
    add nothing to the loss or the gradients.
    """
    ranks = current()
    if ranks.world_size == 1:
        micro = [m for b in batches for m in stream.split(b, micro_batch_size)]
        return micro, sum(m.trained_tokens for m in micro)  # loss = summed token losses / the step's trained tokens
    micro: list = []
    for b in batches:
        per_rank = math.ceil(b.rows / ranks.world_size)
        slices = stream.split(b, per_rank)  # slice r is rank r's (fewer slices than ranks when the batch is short)
        mine = stream.split(slices[ranks.rank], micro_batch_size) if ranks.rank < len(slices) else []
        wanted = math.ceil(per_rank / micro_batch_size)
        micro += mine + [_without_labels(stream.split(slices[0], micro_batch_size)[0])] * (wanted - len(mine))
    num_items = sum(b.trained_tokens for b in batches) / ranks.world_size
    return micro, num_items


def _without_labels(batch):
    """`batch` with no trained token: its forward and backward run (the collectives need them), its loss is 0."""
    return dataclasses.replace(batch, labels=batch.labels.new_full(batch.labels.shape, -100), trained_tokens=0)
