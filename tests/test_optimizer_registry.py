"""The optimizer registry (fitune/specs/optimizers.py): every entry complete, every layer reading it, and a new
entry accepted by the setup's validation and the estimator without touching another file."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import sys

import pytest

from fitune.errors import ConfigError, FituneError
from fitune.specs import optimizers as optimizer_specs
from fitune.specs.optimizers import REGISTRY, OptimizerSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "fitune")

#: Files that may spell optimizer names in a string tuple: the registry itself and translate's foreign vocabularies
#: (other trainers' names mapped onto fitune's).
ALLOWED_NAME_TUPLES = {os.path.join("fitune", "specs", "optimizers.py"), os.path.join("fitune", "translate.py")}


@pytest.mark.parametrize("spec", REGISTRY, ids=lambda s: s.name)
def test_every_entry_is_complete(spec: OptimizerSpec):
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in ("cuda", "trace_note"):  # None has a meaning: runs anywhere / the trace engine refuses it
            assert value is None or (isinstance(value, str) and value), f.name
        elif f.name in ("aliases", "build_kwargs", "packages"):  # may be empty, never None
            assert isinstance(value, tuple), f.name
        elif f.name == "script_classes":  # the doctor reads scripts by these
            assert value and all(isinstance(c, str) and c[:1].isupper() for c in value), f.name
        elif f.name in ("factored", "in_allocator", "takes_foreach"):
            assert isinstance(value, bool), f.name
        elif f.name in ("state_bits", "step_state_bytes_per_param"):
            assert isinstance(value, int) and value >= 0, f.name
        elif f.name in ("state_tensor_bytes", "step_transient_bytes"):
            assert callable(value) and value.__doc__, f"{spec.name}: {f.name} needs a formula with its source"
        else:
            assert isinstance(value, str) and value, f"{spec.name}: {f.name} is not set"
    assert spec.family in ("adam", "adafactor", "sgd")
    assert spec.state_bits in (0, 8, 32)
    assert spec.step_layout in optimizer_specs.STEP_LAYOUTS
    assert spec.step_state_bytes_per_param >= 0
    assert (spec.cuda is None) == (not spec.packages)  # every extra package here is a CUDA kernel library
    assert (spec.trace_note is None) == (spec.cuda is not None)  # the trace engine runs on fake CPU tensors


def test_every_entry_declares_its_state_format():
    """`state_format` has no default: an entry cannot be added without saying whose saved state it loads (--resume's
    policy). Entries of one format must keep the same state: the same formula, precision and update."""
    (f,) = [f for f in dataclasses.fields(OptimizerSpec) if f.name == "state_format"]
    assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    formats: dict[str, list[OptimizerSpec]] = {}
    for spec in REGISTRY:
        assert isinstance(spec.state_format, str) and spec.state_format, spec.name
        formats.setdefault(spec.state_format, []).append(spec)
    for fmt, specs in formats.items():
        assert len({(s.family, s.state_bits, s.state_tensor_bytes, s.factored) for s in specs}) == 1, fmt
    # bitsandbytes' AdamW8bit and PagedAdamW8bit are one class underneath (is_paged only places the state); torch's
    # AdamW keeps other tensors (exp_avg, exp_avg_sq) than bitsandbytes' (state1, state2, absmax1, absmax2)
    assert sorted(sorted(s.name for s in specs) for specs in formats.values()) == [
        ["adafactor"], ["adamw"], ["adamw8bit", "paged_adamw8bit"], ["sgd"]]


def test_canonical_name_reads_aliases():
    assert optimizer_specs.canonical_name("adamw8bit") == "adamw8bit"
    assert optimizer_specs.canonical_name("adamw_bnb_8bit") == "adamw8bit"
    assert optimizer_specs.canonical_name("adamw_torch_fused") == "adamw"
    assert optimizer_specs.canonical_name("lion") is None


@pytest.mark.parametrize("spec", REGISTRY, ids=lambda s: s.name)
def test_state_bytes_by_hand(spec: OptimizerSpec):
    """A 4096 x 4096 fp32 matrix: the state each formula gives, worked out by hand."""
    n = 4096 * 4096
    expected = {"adamw": 2 * 4 * n, "adamw8bit": 2 * (n + 4 * n // 256), "paged_adamw8bit": 2 * (n + 4 * n // 256),
                "adafactor": 4 * (4096 + 4096), "sgd": 0}[spec.name]
    assert spec.state_bytes((4096, 4096), 4) == expected
    if spec.state_bits:  # a stateful optimizer keeps state for a vector too
        assert spec.state_bytes((5000,), 4) > 0


def test_step_transients_by_hand():
    assert optimizer_specs.get("adamw").step_transient_bytes(1000, 10, 2) == 1000  # the foreach lists
    assert optimizer_specs.get("adafactor").step_transient_bytes(1000, 10, 2) == 4 * 4 * 10  # 4 fp32 copies
    assert optimizer_specs.get("adafactor").step_transient_bytes(1000, None, 2) == 1000  # sizes unknown: the bound
    assert optimizer_specs.get("sgd").step_transient_bytes(1000, 10, 2) == 0


def test_names_aliases_and_derived_orders():
    names = optimizer_specs.names()
    assert len(set(names)) == len(names)
    aliases = optimizer_specs.aliases()
    assert not set(aliases) & set(names)
    assert len(aliases) == sum(len(s.aliases) for s in REGISTRY)  # no alias claimed twice
    assert aliases["adamw_bnb_8bit"] == "adamw8bit" and aliases["paged_adamw_8bit"] == "paged_adamw8bit"
    assert optimizer_specs.adam_family() == ("adamw", "adamw8bit", "paged_adamw8bit")
    assert optimizer_specs.by_allocator_memory() == ("sgd", "paged_adamw8bit", "adafactor", "adamw8bit", "adamw")
    with pytest.raises(ConfigError, match="'lion' is not one of: adamw, adamw8bit"):
        optimizer_specs.get("lion")


def test_every_layer_reads_the_registry():
    from fitune import setup, translate
    from fitune.doctor.extract import OPTIMIZER_CLASSES
    from fitune.plan import emit, search
    from fitune.runtime import optim

    names = optimizer_specs.names()
    assert setup.OPTIMIZERS == optim.OPTIMIZERS == search.OPTIMIZER_PREFERENCE == names
    assert set(emit.HF_OPTIM) == set(names) == set(OPTIMIZER_CLASSES.values())
    for alias, name in optimizer_specs.aliases().items():
        assert translate.FOREIGN_OPTIMIZERS[alias][0] == name
        assert setup.TrainSetup.from_dict({"optimizer": alias}).optimizer == name


@pytest.mark.parametrize("spec", REGISTRY, ids=lambda s: s.name)
def test_build_returns_an_optimizer_on_the_cpu(spec: OptimizerSpec):
    torch = pytest.importorskip("torch")
    from fitune.runtime.optim import build_optimizer, optimizer_class

    module, _, attr = spec.build.rpartition(".")
    if spec.cuda is not None:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{spec.name}: {module} is not installed ({spec.cuda} need CUDA)")
        assert hasattr(importlib.import_module(module), attr), spec.build
        pytest.skip(f"{spec.name}: {spec.cuda} need CUDA; the class {spec.build} resolves")
    p = torch.nn.Parameter(torch.ones(8, 4))
    opt = build_optimizer(spec.name, [p], lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert type(opt) is optimizer_class(spec)  # the class the entry names
    p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(8, 4))  # it updated the parameter


def test_a_new_entry_is_built_from_the_registry_alone(monkeypatch):
    """Adding an optimizer needs no edit of fitune/runtime/optim.py: an entry naming a class optim.py never mentions
    (torch.optim.RMSprop) is built from its dotted name with its fixed arguments, foreach passed when it takes it."""
    torch = pytest.importorskip("torch")
    from fitune.runtime.optim import build_optimizer

    fake = dataclasses.replace(optimizer_specs.get("adamw"), name="fakeprop", aliases=(), build="torch.optim.RMSprop",
                               build_kwargs=(("alpha", 0.5),), hf_optim="rmsprop", script_classes=("RMSprop",))
    monkeypatch.setattr(optimizer_specs, "REGISTRY", REGISTRY + (fake,))
    p = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer("fakeprop", [p], lr=0.1, weight_decay=0.2, foreach=False)
    assert type(opt) is torch.optim.RMSprop
    assert opt.defaults["alpha"] == 0.5 and opt.defaults["weight_decay"] == 0.2 and opt.defaults["foreach"] is False
    monkeypatch.setattr(optimizer_specs, "REGISTRY", REGISTRY + (dataclasses.replace(fake, takes_foreach=False),))
    assert build_optimizer("fakeprop", [p], lr=0.1, foreach=True).defaults["foreach"] is None  # not passed


def test_a_missing_package_is_named_with_the_way_out(monkeypatch):
    """An 8-bit optimizer without bitsandbytes: the package, the pip line, the CUDA need and the optimizer to use
    instead, from the entry's `packages` and `cuda` (runtime/needs.py's wording)."""
    from fitune.runtime.optim import build_optimizer, optimizer_class

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes fails, as where it is missing
    for name in ("adamw8bit", "paged_adamw8bit"):
        with pytest.raises(FituneError) as err:
            build_optimizer(name, [], lr=0.1)
        assert str(err.value) == (
            f"this package is not installed: bitsandbytes (for optimizer: {name}); install it with: pip install "
            "bitsandbytes (on a machine with a CUDA GPU: bitsandbytes' 8-bit optimizer kernels), or use optimizer: "
            "adamw"), str(err.value)
    nothing = dataclasses.replace(optimizer_specs.get("adamw"), build="fitune_no_such_module.Opt")
    with pytest.raises(ImportError):  # an entry with no extra package: a broken install, raised as it is
        optimizer_class(nothing)


def _name_tuples(tree: ast.AST):
    """String tuples (and tuple-valued dict literals' keys / values) that contain an optimizer name."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            strings = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(strings) >= 2 and "adamw8bit" in strings:
                yield node.lineno, strings
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if len(keys) >= 2 and "adamw8bit" in keys:
                yield node.lineno, keys


def test_no_other_module_lists_the_optimizers():
    found = []
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fname in filenames:
            path = os.path.join(dirpath, fname)
            rel = os.path.relpath(path, ROOT)
            if not fname.endswith(".py") or rel in ALLOWED_NAME_TUPLES:
                continue
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            found += [f"{rel}:{line}: {strings}" for line, strings in _name_tuples(tree)]
    assert not found, "optimizer names listed outside fitune/specs/optimizers.py:\n" + "\n".join(found)


def test_a_new_entry_is_accepted_by_setup_and_estimated(monkeypatch):
    """Adding an optimizer is one entry: a fake one (AdamW's formulas at half the state) validates and estimates."""
    from fitune.memory.estimate import estimate
    from fitune.plan.throughput import optimizer_step_bytes
    from fitune.setup import TrainSetup
    from fitune.specs.model import load_model_spec

    def half_state(shape, param_bytes):
        return [n // 2 for n in optimizer_specs.adamw_state_tensor_bytes(shape, param_bytes)]

    fake = dataclasses.replace(optimizer_specs.get("adamw"), name="fakeadam", aliases=("fake_adam",),
                               state_tensor_bytes=half_state, step_state_bytes_per_param=8, hf_optim="fake_adam",
                               label="fake Adam", script_classes=("FakeAdam",))
    monkeypatch.setattr(optimizer_specs, "REGISTRY", REGISTRY + (fake,))
    model = load_model_spec("llama-3.2-1b")
    setup = TrainSetup(method="full", optimizer="fakeadam", seq_len_tokens=256, batch_size=1)
    setup.validate()
    with pytest.raises(ConfigError, match="'nosuch' is not one of: adamw, .*, fakeadam"):
        setup.replace(optimizer="nosuch").validate()
    fake_est = estimate(model, setup)
    adamw_est = estimate(model, setup.replace(optimizer="adamw"))
    assert fake_est.resident_bytes["optimizer_states"] * 2 == adamw_est.resident_bytes["optimizer_states"]
    assert optimizer_step_bytes(model, setup) < optimizer_step_bytes(model, setup.replace(optimizer="adamw"))


def test_throughput_refuses_an_unknown_optimizer():
    """No silent default: an optimizer the registry does not know is an error, not AdamW's bytes."""
    from fitune.plan.throughput import optimizer_step_bytes
    from fitune.setup import TrainSetup
    from fitune.specs.model import load_model_spec

    bogus = dataclasses.replace(TrainSetup(), optimizer="lion")  # past validation, as a hand-made setup could be
    with pytest.raises(ConfigError, match="'lion' is not one of"):
        optimizer_step_bytes(load_model_spec("llama-3.2-1b"), bogus)


def test_a_resumed_paged_optimizer_pages_its_loaded_state_again():
    """bitsandbytes' load_state_dict leaves a paged optimizer's state1 / state2 as ordinary GPU tensors; after
    fitune's checkpoint.load they are back in paged buffers (large parameters only, as bitsandbytes pages them),
    values kept. Modelled on the CPU: parameters that say they are on CUDA, a stand-in for get_paged."""
    import types

    import torch

    from fitune.runtime.optim import BNB_PAGED_MIN_NUMEL, page_loaded_state

    class Param:
        def __init__(self, n):
            self.n, self.device = n, types.SimpleNamespace(type="cuda", index=0)

        def numel(self):
            return self.n

    def get_paged(*shape, dtype, device):
        out = torch.zeros(shape, dtype=dtype)
        out.is_paged = True
        return out

    big, small = Param(BNB_PAGED_MIN_NUMEL), Param(BNB_PAGED_MIN_NUMEL - 1)
    states = {p: {"state1": torch.full((4,), 3, dtype=torch.uint8), "state2": torch.full((4,), 5, dtype=torch.uint8),
                  "absmax1": torch.ones(1)} for p in (big, small)}
    opt = types.SimpleNamespace(is_paged=True, param_groups=[{"params": [big, small]}], state=states,
                                page_mng=types.SimpleNamespace(paged_tensors=[]))
    assert page_loaded_state(opt, get_paged) == 2
    assert all(getattr(states[big][k], "is_paged", False) for k in ("state1", "state2"))
    assert states[big]["state1"].tolist() == [3] * 4 and states[big]["state2"].tolist() == [5] * 4
    assert not hasattr(states[small]["state1"], "is_paged")  # under the size bitsandbytes pages from
    assert len(opt.page_mng.paged_tensors) == 2
    assert page_loaded_state(opt, get_paged) == 0  # already paged: nothing moves again
    assert page_loaded_state(types.SimpleNamespace(is_paged=False), get_paged) == 0  # not a paged optimizer
