"""`lora.dropout` reaches PEFT in every place that builds LoRA: the runner, the trace engine and `plan --emit hf`
(it was accepted, validated and translated, then dropped by the runner, which hard-coded 0.0)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from fitune.runtime.model import build_model, prepare_model  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402
from tests.tiny import make_model_folder  # noqa: E402


def _dropouts(model) -> set:
    from peft.tuners.lora import LoraLayer

    out = set()
    for m in model.modules():
        if isinstance(m, LoraLayer):
            for drop in m.lora_dropout.values():
                out.add(drop.p if isinstance(drop, torch.nn.Dropout) else 0.0)
    return out


@pytest.mark.parametrize("lean", [False, True])
def test_the_runner_builds_lora_with_the_dropout_asked(tmp_path, lean):
    folder = make_model_folder(str(tmp_path / "m"))
    s = TrainSetup(stack="fitune", method="lora", dtype="fp32", lora_dropout=0.25, lean_lora=lean,
                   lora_targets=("q_proj", "v_proj"))
    model = prepare_model(build_model(folder, dtype_name="fp32"), s)
    assert _dropouts(model) == {0.25}
    # training mode: dropout draws a new mask each forward, so two forwards of one batch differ once B is non-zero
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.arange(2, 18).unsqueeze(0)
    model.train()
    torch.manual_seed(0)
    a = model(input_ids=ids).logits
    b = model(input_ids=ids).logits
    assert not torch.equal(a, b)
    model.eval()  # and none at evaluation
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_no_dropout_is_peft_identity(tmp_path):
    folder = make_model_folder(str(tmp_path / "m"))
    model = prepare_model(build_model(folder, dtype_name="fp32"), TrainSetup(stack="fitune", dtype="fp32"))
    assert _dropouts(model) == {0.0}


def test_plan_emit_hf_writes_the_dropout():
    import contextlib
    import io

    from fitune.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "512", "--lora-dropout", "0.05",
                     "--emit", "hf"]) == 0
    assert "lora_dropout=0.05," in out.getvalue()
