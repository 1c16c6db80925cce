"""Every config key has an effect on what `fitune train` builds and does, or is declared estimate-only with why
(issue 34: `lora.dropout` was accepted, validated and translated, then dropped by the runner).

Two checks, generated from the schema (`fitune.config.ALL_KEYS`: a new key is covered without editing this file,
and fails until it is read by the runner or declared here):

1. Reads: one short CPU run of `fitune.train.loop.train`, with every TrainSetup / TrainConfig / DataConfig field
   read recorded where the reading code is the runner's (fitune.runtime, fitune.train, fitune.data,
   fitune.parallel; not serialization, validation or equality). A key the runner never reads is a bug, unless
   `NOT_READ_ON_THIS_RUN` names it with the path that reads it, or `ESTIMATE_ONLY` with why it changes no run.
2. Effects: changing each of the keys that shape what is built (the PEFT adapters, the optimizer, the schedule,
   the data pipeline) changes the built object as the key says.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from fitune import config as config_mod  # noqa: E402
from fitune.config import ALL_KEYS, DataConfig, TrainConfig  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402

from tests.tiny import make_chat_data, make_model_folder  # noqa: E402

RUNNER_MODULES = ("fitune.runtime", "fitune.train", "fitune.data", "fitune.parallel")
#: Functions whose reads are not the runner using a key: they copy, compare, print or check every field.
NOT_USES = {"to_dict", "asdict", "_asdict_inner", "replace", "__eq__", "__hash__", "__repr__", "validate",
            "_value_problems", "_lora_problems", "_runner_technique_problems", "_compiled_layers_problems",
            "_combination_problems", "_checkpointing_problems", "flat_values", "to_mapping", "check_config_changes",
            "flat_config", "preflight_problems", "fingerprint", "__post_init__", "<genexpr>",
            "<listcomp>", "<dictcomp>"}

#: Keys a CPU run of one GPU does not reach, with the code path that reads them (tested where named).
NOT_READ_ON_THIS_RUN = {
    "epochs": "a run given epochs instead of max_steps (fitune/train/loop.py; tests/test_train.py)",
    "freeze_trainable_layers": "method: freeze (test_method_and_freeze_layers_set_what_trains below)",
    "oom_guard": "a step that runs out of memory (tests/test_train.py::test_injected_oom_is_survived_without_losing_"
                 "or_repeating_data)",
}

#: Keys that describe what is estimated, not what the runner builds, with why.
ESTIMATE_ONLY = {
    "stack": "which software is modelled by estimate / plan (hf: transformers' recipe, fitune: this runner); "
             "fitune train always runs fitune's runner (TrainConfig's default stack: fitune)",
    "keep_outputs": "estimates a user's own loop that keeps the model output through backward; fitune's runner "
                    "never keeps it (plan refuses --keep-outputs with --write)",
}


def _dotted(key) -> str:
    return key.yaml


def _record_reads(monkeypatch) -> set[str]:
    """Patch the three config classes so that each field read by runner code is recorded (as its YAML name)."""
    reads: set[str] = set()
    yaml_of = {k.field: k.yaml for k in ALL_KEYS}  # field names are unique across the three classes' keys
    fields_of = {cls: set(cls.__dataclass_fields__) for cls in (TrainSetup, TrainConfig, DataConfig)}

    def make(cls):
        original = object.__getattribute__
        names = fields_of[cls]

        def getattribute(self, name):
            if name in names:
                frame = sys._getframe(1)
                while frame is not None:
                    code = frame.f_code.co_name
                    if code in NOT_USES:
                        break
                    module = frame.f_globals.get("__name__", "")
                    if module.startswith(RUNNER_MODULES):
                        reads.add(yaml_of.get(name, name))
                        break
                    if not module.startswith(("fitune.setup", "fitune.config", "fitune.schema")):
                        break  # a read from elsewhere (the test, a library): not the runner's
                    frame = frame.f_back  # a property of the config itself (setup.py): who asked for it
            return original(self, name)

        return getattribute

    for cls in (TrainSetup, TrainConfig, DataConfig):
        monkeypatch.setattr(cls, "__getattribute__", make(cls))
    return reads


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    model = make_model_folder(str(root / "model"))
    return model, make_chat_data(str(root / "train.jsonl"), n=24), make_chat_data(str(root / "eval.jsonl"), n=8,
                                                                                     seed=1)


def _config(workspace, out, **setup_changes) -> TrainConfig:
    model, data, eval_data = workspace
    setup = TrainSetup(stack="fitune", method="lora", dtype="fp32", seq_len_tokens=32, batch_size=2, grad_accum=2,
                       lora_targets=("q_proj", "v_proj"), loss="chunked", **setup_changes)
    return TrainConfig(model=model, setup=setup, data=DataConfig(path=data, eval_path=eval_data, format="chat"),
                       output_dir=str(out), max_steps=3, lr=1e-3, save_every=2, eval_every=2, log_every=1,
                       keep_checkpoints=2, merge=True, packing=True, schedule="cosine", warmup_steps=1, seed=1)


def test_every_key_is_read_by_the_runner_or_declared(workspace, tmp_path, monkeypatch):
    from fitune.train.loop import train

    cfg = _config(workspace, tmp_path / "run")
    reads = _record_reads(monkeypatch)
    train(cfg, progress=False)
    monkeypatch.undo()
    keys = {_dotted(k) for k in ALL_KEYS}
    declared = set(NOT_READ_ON_THIS_RUN) | set(ESTIMATE_ONLY)
    assert declared <= keys, f"declared keys that are not config keys: {sorted(declared - keys)}"
    unread = sorted(keys - reads - declared)
    assert not unread, (f"config keys the runner never read in a CPU run: {unread}; each is either a bug (the key "
                        "is accepted and ignored) or belongs in NOT_READ_ON_THIS_RUN / ESTIMATE_ONLY with why")
    stale = sorted(k for k in NOT_READ_ON_THIS_RUN if k in reads)
    assert not stale, f"read on this run after all, so no longer to be declared: {stale}"


# ---- effects: what the key shapes changes as it says ---------------------------------------------------------


def _lora_config(model):
    return next(iter(model.peft_config.values()))


@pytest.mark.parametrize("field, value, check", [
    ("lora_rank", 4, lambda c: c.r == 4),
    ("lora_alpha", 3, lambda c: c.lora_alpha == 3),
    ("lora_dropout", 0.25, lambda c: c.lora_dropout == 0.25),
    ("lora_targets", ("k_proj",), lambda c: set(c.target_modules) == {"k_proj"}),
])
def test_each_lora_key_reaches_peft(workspace, field, value, check):
    from fitune.runtime.model import build_model, prepare_model

    base = TrainSetup(stack="fitune", method="lora", dtype="fp32", lora_targets=("q_proj", "v_proj"))
    built = prepare_model(build_model(workspace[0], dtype_name="fp32"), base.replace(**{field: value}))
    assert check(_lora_config(built)), _lora_config(built)
    default = prepare_model(build_model(workspace[0], dtype_name="fp32"), base)
    assert not check(_lora_config(default))  # the default builds something else: the key made the difference


@pytest.mark.parametrize("method, trainable", [
    ("lora", lambda n: "lora_" in n),
    ("full", lambda n: True),
    ("freeze", lambda n: "layers.1." in n),  # the tiny model's last layer (freeze_trainable_layers: 1)
])
def test_method_and_freeze_layers_set_what_trains(workspace, method, trainable):
    from fitune.runtime.model import build_model, prepare_model

    s = TrainSetup(stack="fitune", method=method, dtype="fp32", freeze_trainable_layers=1,
                   lora_targets=("q_proj", "v_proj"))
    model = prepare_model(build_model(workspace[0], dtype_name="fp32"), s)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(trainable(n) for n in names), names


@pytest.mark.parametrize("name, kind", [("adamw", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor")])
def test_optimizer_lr_and_weight_decay_reach_the_optimizer(name, kind):
    from fitune.runtime.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    opt = build_optimizer(name, params, lr=0.0123, weight_decay=0.07)
    assert type(opt).__name__ == kind
    group = opt.param_groups[0]
    assert group["lr"] == 0.0123 and group.get("weight_decay", 0.07) == 0.07


def test_schedule_and_warmup_shape_the_learning_rate(workspace, tmp_path):
    from fitune.train import loop

    def lrs(**changes):
        cfg = dataclasses.replace(_config(workspace, tmp_path / "s"), **changes)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched = loop._scheduler(cfg, opt, 10)
        out = []
        for _ in range(10):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    cosine, constant = lrs(schedule="cosine", warmup_steps=0), lrs(schedule="constant", warmup_steps=0)
    assert len(set(constant)) == 1 and cosine[-1] < cosine[0]
    warm = lrs(schedule="constant", warmup_steps=4)
    assert warm[0] < warm[4] == constant[4]


def test_data_keys_shape_the_batches(workspace):
    """seq_len cuts the rows, batch_size sets the rows per micro-batch, packing joins examples in a row, the
    format reads the records as said."""
    from fitune import data as data_mod
    from fitune.runtime.model import load_tokenizer

    tokenizer = load_tokenizer(workspace[0])
    records = data_mod.read_records(workspace[1])
    items, _ = data_mod.tokenize_records(list(records), tokenizer, "chat", 12)
    assert max(len(i.input_ids) for i in items) <= 12
    longer, _ = data_mod.tokenize_records(list(data_mod.read_records(workspace[1])), tokenizer, "chat", 64)
    assert max(len(i.input_ids) for i in longer) > 12
    packed = data_mod.pack(longer, 64)
    assert len(packed) < len(longer)  # packing joins short examples into fewer rows
    stream = data_mod.BatchStream(longer, 3, seed=0, pad_token_id=0, packed=False, shuffle=False)
    assert stream.next_batch().input_ids.shape[0] == 3


def test_the_config_module_lists_every_key_once():
    names = [_dotted(k) for k in config_mod.ALL_KEYS]
    assert len(names) == len(set(names))
