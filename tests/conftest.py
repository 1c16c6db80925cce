import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402


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
