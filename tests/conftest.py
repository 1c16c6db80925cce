import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402

# One math thread per pytest-xdist worker (and the fitune processes the tests start, which inherit it): two workers
# on CI's two cores each asking for two OpenMP threads made four threads contend for two cores. Set before torch is
# imported; a value the environment already gives is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

#: The longest tests (CI's `--durations`), collected first: pytest-xdist's load scheduler hands the first tests out
#: one per worker, so each starts at once instead of ending the run alone. The persona test (10.6 min) ran last on one
#: worker while the other sat idle, and CI's pytest took 31 min (2026-12-07).
LONGEST_FIRST = ("test_lora_on_the_cpu_teaches_the_real_model_its_persona",
                 "test_runner_trains_what_the_reference_loop_trains",
                 "test_zero3_on_two_cpu_ranks_trains_the_global_batch_as_one_process_does",
                 "test_real_model_q8_0_reads_back_within_the_stated_tolerance",
                 "test_train_two_steps_from_the_gguf_file",
                 "test_fifty_kill_9_at_random_moments_lose_nothing")


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's tests first, in its order; the rest keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(getattr(item, "originalname", item.name), len(rank)))


def _need_real_model():
    from tests.real_model import missing_reason

    reason = missing_reason()
    if reason:
        if os.environ.get("CI"):  # CI installs it (make test): missing there is a failure, not a skip
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def real_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file (tests/real_model.py)."""
    _need_real_model()
    from tests.real_model import gguf_path

    return gguf_path()


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """A Hugging Face folder of SmolLM2-135M-Instruct, fp32 (tests/real_model.py); treat it as read-only."""
    _need_real_model()
    from tests.real_model import model_folder

    return model_folder()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama folder of random weights and bench/peers/make_model.py's word-level tokenizer, written on the
    CPU: the peer scripts' tests (tests/test_peers_more.py, tests/test_real_length_stacks.py) run on it."""
    import subprocess

    pytest.importorskip("torch")
    pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("peers") / "tiny"
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "bench/peers/make_model.py", "--out", str(folder), "--device", "cpu", "--layers", "2",
         "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "8192", "--rows",
         "8", "--seq-len", "64"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder
