"""metrics.jsonl's `alloc_retries`: each step's count of the CUDA allocator's free-and-retry (issue 33's goal of no
retries in steady state is read from it). The CUDA counter is replaced by a stand-in here (no GPU in CI)."""

import torch

from fitune.train import loop


def test_alloc_retries_reads_the_cuda_counter_and_is_zero_off_cuda(monkeypatch):
    counts = iter([3, 7])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": next(counts)})
    before = loop._alloc_retries("cuda")
    assert loop._alloc_retries("cuda") - before == 4  # the step's own retries: the counter is never reset
    assert loop._alloc_retries("cpu") == 0
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})  # a fresh process: the key is absent
    assert loop._alloc_retries("cuda") == 0
