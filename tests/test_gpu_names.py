"""GPU names as people write them (issue 31): one resolver for every command's --gpu / --cap / cap:."""

import pytest

from fitune.errors import UnknownGpuError
from fitune.specs.gpu import card_of_size, catalog_gpu_key, resolve_gpu
from fitune.units import GiB


@pytest.mark.parametrize("text, key", [
    ("rtx4090", "rtx4090"),
    ("4090", "rtx4090"),
    ("RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),  # what nvidia-smi prints
    ("RTX 4090 24GB", "rtx4090"),
    ("3090", "rtx3090"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("H100", "h100"),
    ("NVIDIA H200", "h200"),
    ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("NVIDIA RTX A6000", "a6000"),
    ("RTX 4070 Ti SUPER", "rtx4070-ti-super"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx6000-ada"),
])
def test_names_people_write_resolve_to_the_catalog_card(text, key):
    assert catalog_gpu_key(text) == key
    gpu = resolve_gpu(text)
    assert gpu.name == key
    assert gpu.allocator_budget_bytes == resolve_gpu(key).allocator_budget_bytes
    assert (gpu.note == "") == (text.lower() == key)  # a name read another way says how it was read


@pytest.mark.parametrize("text", ["a100", "v100", "rtx4090x", "4091"])
def test_ambiguous_or_unknown_names_are_refused_with_the_closest(text):
    assert catalog_gpu_key(text) is None
    with pytest.raises(UnknownGpuError, match="is not a known GPU; closest"):
        resolve_gpu(text)


def test_a_size_in_gb_is_the_card_sold_with_it_and_gives_its_verdict():
    """`--gpu 24GB` is a 24 GB card (the smallest in the catalog: an RTX 4090), so it gives the same budget, hence
    the same verdict, as `--gpu rtx4090`; the note says the reading."""
    assert card_of_size("24GB") == "rtx4090"
    gpu = resolve_gpu("24GB")
    assert gpu.name == "rtx4090"
    assert gpu.allocator_budget_bytes == resolve_gpu("rtx4090").allocator_budget_bytes
    assert "read as a card sold as 24GB" in gpu.note and "--gpu 23.4GiB" in gpu.note
    assert resolve_gpu("141GB").name == "h200"
    with pytest.raises(UnknownGpuError, match="no catalog card is sold with that much memory"):
        resolve_gpu("7GB")


def test_a_budget_in_gib_is_taken_as_given_and_says_why_it_differs_from_the_card():
    """`--gpu 24GiB` is 24 GiB for the allocator; an RTX 4090 leaves 23.4 GiB after its CUDA context, so the two give
    different verdicts: the note says so, naming the card flag that models the card."""
    gpu = resolve_gpu("24GiB")
    assert gpu.allocator_budget_bytes == 24 * GiB
    assert "rtx4090" in gpu.note and "leaves 23.4 GiB after its CUDA context" in gpu.note
    assert resolve_gpu("23.4GiB").note == ""  # an allocator budget that is no card's size: nothing to explain


def test_estimate_and_plan_print_the_reading(capsys):
    from fitune.cli.main import main

    assert main(["estimate", "llama-3.1-8b", "--seq-len", "512", "--gpu", "NVIDIA GeForce RTX 4090"]) == 0
    out = capsys.readouterr().out
    assert "rtx4090: 23.40 GiB for PyTorch's allocator" in out
    assert "('NVIDIA GeForce RTX 4090' read as rtx4090" in out
    assert main(["plan", "llama-3.1-8b", "--seq-len", "512", "--gpu", "24GiB"]) == 0
    assert "a card of that size leaves less: rtx4090" in capsys.readouterr().out
