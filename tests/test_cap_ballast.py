"""`cap:` on a bigger GPU (fitune/runtime/device.py `limit_allocator`): PyTorch's memory fraction by default; with
FITUNE_CAP_MODE=ballast the memory beyond the budget taken outside PyTorch's allocator, as the smaller card has it."""

import pytest

torch = pytest.importorskip("torch")

from fitune.runtime import device  # noqa: E402


def test_ballast_takes_the_free_memory_pytorch_may_not_reserve():
    gib = 2 ** 30
    # 70 GiB free, budget 23.4 GiB of which PyTorch already reserved 1 GiB: it may reserve 22.4 GiB more
    assert device.ballast_bytes(70 * gib, int(23.4 * gib), 1 * gib) == 70 * gib - int(22.4 * gib)
    assert device.ballast_bytes(10 * gib, 23 * gib, 0) == 0  # the card is already smaller than the budget


def test_the_fraction_is_the_default_and_ballast_is_opt_in(monkeypatch):
    fractions, held = [], []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fractions.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2 ** 30}))
    monkeypatch.setattr(device, "_hold_ballast", held.append)
    monkeypatch.delenv(device.CAP_MODE_ENV, raising=False)
    device.limit_allocator(20 * 2 ** 30)
    assert fractions == [0.25] and held == []
    monkeypatch.setenv(device.CAP_MODE_ENV, "ballast")
    device.limit_allocator(20 * 2 ** 30)
    assert fractions == [0.25, 1.0] and held == [20 * 2 ** 30]
    device.limit_allocator(None)  # lifting the cap: the fraction back to 1, no ballast
    assert fractions[-1] == 1.0 and held == [20 * 2 ** 30]


def test_ballast_without_a_cuda_runtime_says_how_to_cap_instead(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(maps if path == "/proc/self/maps" else path,
                                                                        *a, **k))
    with pytest.raises(RuntimeError, match="unset it to cap with PyTorch's memory fraction"):
        device._cudart()


def test_a_misspelt_cap_mode_is_refused_with_the_known_one(monkeypatch):
    from fitune.errors import ConfigError

    monkeypatch.setenv(device.CAP_MODE_ENV, "balast")
    with pytest.raises(ConfigError, match="FITUNE_CAP_MODE=balast: not a cap mode; set it to ballast"):
        device.limit_allocator(20 * 2 ** 30)


def test_outside_allocator_bytes_leaves_out_the_allocator_and_the_ballast(monkeypatch):
    """A step line's `outside_allocator_bytes`: what the GPU has in use beyond PyTorch's reserved memory and the
    ballast (the CUDA context, kernel images loaded so far, other processes)."""
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10 * gib, 80 * gib))  # 70 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 20 * gib)
    monkeypatch.setattr(device, "_BALLAST", [(None, None, 49 * gib)])
    assert device.ballast_held_bytes() == 49 * gib
    assert device.outside_allocator_bytes() == 1 * gib
    monkeypatch.setattr(device, "_BALLAST", [])
    assert device.outside_allocator_bytes() == 50 * gib
