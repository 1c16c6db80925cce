"""`--engine trace`: run the real transformers model + PEFT + loss on fake tensors and measure memory.

`trace_training_step(model, setup)` builds the model of any config.json that `AutoModelForCausalLM.from_config`
can build (GPT-NeoX, Falcon, ... not only the architectures the analytic engine models), applies the
`TrainSetup` (LoRA, full or freeze; checkpointing; attention; optimizer; gradient accumulation) and executes
the HF recipe (`fitune.runtime.model`: build, PEFT LoRA, checkpointing) op by op under PyTorch's
`FakeTensorMode`: every tensor has its real shape, dtype, strides and storage size, but no data, so an 8B
model with a batch of 2 x 2048 tokens "runs" on a laptop CPU in seconds and allocates nothing real. Each
TrainSetup field is run as given or refused by name (fitune/trace/support.py lists which); no value is ever
swapped for another. Memory is measured by
`fitune.trace.tracker` (a `TorchDispatchMode` that weakly follows every storage an op creates, counts each
storage once, however many views share it, and sorts it into params / buffers / inputs / activations /
temporaries / grads / optimizer; its docstring says why PyTorch's own `MemTracker` is not used).

What is measured (all in bytes, storages counted once):

* weights / adapter weights / gradients / optimizer states: read off the model and the optimizer after the
  last step's backward and optimizer step;
* saved activations (no checkpointing): unique storages that autograd saved during the last forward,
  parameters excluded, through `torch.autograd.graph.saved_tensors_hooks` (exactly what the GPU bench does);
* saved activations (checkpointing full or selective:K): non-reentrant checkpointing installs its own
  `saved_tensors_hooks`, which hide what is saved inside each checkpointed layer from an outer hook, so
  here it is (live bytes right after the forward) - (live bytes right before it): what the checkpoint
  frames keep (each layer's input), what the other layers and the non-checkpointed parts (embedding,
  final norm, lm_head, loss) save, plus the loss scalar;
* phase peaks: the highest live-bytes total seen during the last step's forward, backward and optimizer
  step (`opt.step()` + `opt.zero_grad(set_to_none=True)` + dropping the loss), for the steady state
  (the optimizer state exists from the second step on). With `grad_accum` > 1 the step runs two
  micro-batches, `(loss / grad_accum).backward()` each: the second starts with the accumulated gradients
  alive, and every later one would start from that same memory, so two give the step's exact peaks.

Fidelity notes. Fake tensors live on a fake *CPU* device (this torch build has no CUDA, and fake CUDA
needs it), so the numbers are exact tensor bytes without the CUDA caching allocator's 512-byte rounding,
fragmentation or reserved-but-free memory, without the CUDA context, and without cuBLAS / flash-attention
workspaces. SDPA picks the CPU flash kernel (which saves the output and the fp32 logsumexp, like the CUDA
flash kernel). AdamW and SGD run with `foreach=True`, the implementation PyTorch picks by default for CUDA
tensors (on CPU it would default to the per-parameter loop, whose temporaries are smaller).

Checked against the H200 bench (bench/results/hf_recipe, the 37 bf16 LoRA cases, 5 architectures, both
attention implementations, with and without checkpointing): the saved-tensor bytes agree to the byte
(+-512 B), and the forward / backward / optimizer peaks measured from the step's start agree within 1 MiB in
32 cases (the others: 5-43 MiB, foreach-AdamW temporaries of very large adapters and two short-sequence
cases); absolute peaks come out 64-67 MiB (0.1-0.6 %) lower, the bench's non-tensor allocations.

Two library quirks are worked around for the duration of a fake run (so a run is not thread-safe): PEFT's
`.to()` of each new LoRA layer fails on fake parameters (`torch.utils.swap_tensors` refuses the weakref that
FakeTensorMode's memo puts on them), and transformers treats fake position ids as "tracing" and would build
a packed-sequence attention mask that the real run never builds. See `_fake_swap_fix` and
`_no_packed_sequence_detection`; with both, the fake run matches the same run on real tensors byte for byte
(tests/test_trace_engine.py).

`import fitune.trace` does not import torch: torch, transformers and peft are imported inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from fitune.errors import ConfigError, FituneError, UnknownModelError
from fitune.runtime.optim import build_optimizer
from fitune.setup import TrainSetup
from fitune.specs import optimizers as optimizer_specs
from fitune.specs.model import resolve_model_source
from fitune.trace.support import TraceModelError, TraceUnsupportedError, check_setup
from fitune.trace.tracker import make_tracker

logger = logging.getLogger(__name__)

__all__ = ["TraceModelError", "TraceResult", "TraceUnsupportedError", "trace_training_step"]


@dataclass(frozen=True)
class TraceResult:
    """What one traced HF-recipe run measured (bytes; each storage counted once)."""

    weights_bytes: int  # frozen (non-trainable) parameters and buffers
    adapter_weights_bytes: int  # trainable parameters (LoRA A/B for lora; everything for full)
    gradients_bytes: int  # .grad of trainable parameters after backward
    optimizer_states_bytes: int  # optimizer state (AdamW: exp_avg, exp_avg_sq, step) after opt.step()
    saved_activations_bytes: int  # see the module docstring (hooks; live-bytes difference when checkpointed)
    forward_peak_bytes: int  # peak of live tensor bytes during the last step's forward(s) (all categories)
    backward_peak_bytes: int  # peak during the last step's backward(s)
    optimizer_peak_bytes: int  # peak during the last optimizer step (+ zero_grad)
    peak_bytes: int  # max over the three (steady state: the last step)
    by_category: dict[str, int]  # live bytes per category at `peak_bytes`
    notes: tuple[str, ...]
    # Extras (not needed by the estimate, useful to explain it):
    step_start_bytes: int = 0  # live bytes when the last step starts (weights, adapter, optimizer state, ids)
    after_forward_bytes: int = 0  # live bytes right after the last forward
    saved_hooks_bytes: int = 0  # what an outer saved_tensors_hooks saw (checkpointed: only outside the layers)
    trainable_params: int = 0
    frozen_params: int = 0
    peak_phase: str = ""  # "forward" | "backward" | "optimizer"
    phase_peaks_by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    model: str = ""  # the model's name (catalog name, folder name, or the config's model_type)
    model_type: str = ""  # config.json's model_type
    setup: TrainSetup | None = None  # the setup that was traced: the one given (PEFT's default LoRA targets
    # replace fitune's default q_proj,v_proj when the model has neither; a note says so)
    micro_batches_traced: int = 1  # per step: min(grad_accum, 2), see the module docstring

    @property
    def total_params(self) -> int:
        return self.trainable_params + self.frozen_params


def trace_training_step(model: Any, setup: TrainSetup, *, steps: int = 2) -> TraceResult:
    """Run `steps` HF-recipe training steps of `setup` on fake tensors (CPU, no weights, no real memory); measure.

    Args:
        model: a config.json dict (it needs `model_type`); a catalog name, config.json path or model folder;
            or anything with an `hf_config` dict and a `name` (`ModelSpec`, `ModelSource`). Any architecture
            `AutoModelForCausalLM.from_config` builds.
        setup: the training setup. Each field is run as given or refused by name (fitune/trace/support.py):
            e.g. method lora / full / freeze run (LoRA as the recipe's `wrap_lora`, adapters in fp32), qlora is
            refused (bitsandbytes needs CUDA).
        steps: steps to run; the numbers describe the last one (2: AdamW's state exists from the second on).

    Returns:
        The measurements; `result.setup is setup`, except when `setup.lora_targets` is fitune's default
        (q_proj, v_proj) and the model has neither: then, as PEFT does with `target_modules=None`, PEFT's default
        targets for the model_type are modelled, `result.setup` names them and a note says so. See the module docstring for what each number means.

    Raises:
        TraceUnsupportedError: settings the trace cannot model, each named with its flag.
        ConfigError: an invalid setup (`TrainSetup.validate`), or LoRA targets the model does not have.
        UnknownModelError: MODEL cannot be resolved, or its config.json has no `model_type`.
        TraceModelError: transformers cannot build the model, or the fake-tensor run of it failed.
    """
    name, hf_config = _resolve_model(model)
    return _trace(hf_config, setup, steps=steps, fake=True, name=name)


def _resolve_model(model: Any) -> tuple[str, dict]:
    """(name, config.json dict) of whatever `trace_training_step` was given."""
    if isinstance(model, str):
        src = resolve_model_source(model)
        name, cfg = src.name, src.hf_config
    elif isinstance(model, dict):
        name, cfg = "", model
    else:
        name, cfg = getattr(model, "name", ""), getattr(model, "hf_config", None)
        if not isinstance(cfg, dict):
            raise TypeError(f"trace_training_step takes a config.json dict, a MODEL string or a ModelSpec; got "
                            f"{type(model).__name__}")
    if not cfg.get("model_type"):
        raise UnknownModelError(f"{name or 'config.json'}: config.json has no 'model_type' key; is this a Hugging "
                                "Face model config?")
    return name, cfg


def _trace(hf_config: dict, setup: TrainSetup, *, steps: int = 2, fake: bool = True, seed: int = 0,
           name: str = "") -> TraceResult:
    """The engine. `fake=False` runs the very same code on real CPU tensors (for the tests, tiny models only)."""
    notes = check_setup(setup)  # refuses what cannot be modelled, by name, before anything is built
    setup.validate()
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    model_type = str(hf_config.get("model_type", ""))
    name = name or str(hf_config.get("_name_or_path") or "") or model_type
    label = name if name == model_type else f"{name} (model_type {model_type!r})"  # for messages
    import torch

    import fitune.runtime.model  # noqa: F401 - transformers and PEFT load before the clock starts (elapsed_s)

    t0 = time.perf_counter()
    micro_batches = min(setup.grad_accum, 2)  # micro-batches 2..N start from the same memory: two are exact
    with _run_context(torch, fake):
        torch.manual_seed(seed)
        # the setup modelled from here on: PEFT's default LoRA targets may replace fitune's default
        model, setup, trainable, opt, ids = _prepare_model(hf_config, setup, label, model_type, notes)
        rec = _PhaseRecorder(model, trainable, ids, setup, micro_batches, fake)
        _run_steps(model, opt, ids, steps, micro_batches, rec, label)
        sizes = _state_sizes(model, trainable, opt, fake)
    saved = _saved_activations(setup, rec, notes)
    if setup.keep_outputs:
        notes.append("keep_outputs: the model output (logits, KV cache) stays alive through the backward, then goes")
    if micro_batches > 1:
        notes.append(f"grad_accum {setup.grad_accum}: two micro-batches traced per step; the second starts with "
                     "the accumulated gradients alive, as every later one does")
    phases = rec.phases
    peak_phase = max(phases, key=lambda k: phases[k][0])
    peak_bytes, by_category = phases[peak_phase]
    notes.append(
        "tensor bytes only (fake CPU tensors): add the CUDA context, library workspaces (the H200 bench holds "
        "64 MiB more allocated than the tensors from the first step on, cuBLAS workspaces most likely) and the "
        "caching allocator's rounding, fragmentation and reserved-but-free memory"
    )
    notes.append(optimizer_specs.get(setup.optimizer).trace_note)  # how the registry's entry runs here
    return TraceResult(
        **sizes,
        gradients_bytes=rec.grads_bytes,
        saved_activations_bytes=saved,
        forward_peak_bytes=phases["forward"][0],
        backward_peak_bytes=phases["backward"][0],
        optimizer_peak_bytes=phases["optimizer"][0],
        peak_bytes=peak_bytes,
        by_category=by_category,
        notes=tuple(notes),
        step_start_bytes=rec.start_bytes,
        after_forward_bytes=rec.after_fwd_bytes,
        saved_hooks_bytes=rec.saved_hooks_bytes,
        peak_phase=peak_phase,
        phase_peaks_by_category={k: v[1] for k, v in phases.items()},
        elapsed_s=time.perf_counter() - t0,
        model=name,
        model_type=model_type,
        setup=setup,
        micro_batches_traced=micro_batches,
    )


# ------------------------------------------------------------------------------------- the run, step by step


def _run_context(torch, fake: bool) -> contextlib.ExitStack:
    """The caller's RNG state kept apart; with `fake`, FakeTensorMode and the two library workarounds (module
    docstring)."""
    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.random.fork_rng(devices=[]))  # leave the caller's RNG state alone
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        mode = FakeTensorMode(shape_env=ShapeEnv())  # train_step's loss.item() needs a ShapeEnv on fake tensors
        ctx.enter_context(mode)
        ctx.enter_context(_fake_swap_fix(mode))
        ctx.enter_context(_no_packed_sequence_detection())
    return ctx


def _prepare_model(hf_config: dict, setup: TrainSetup, label: str, model_type: str, notes: list):
    """The HF recipe applied to a freshly built model: (model, the setup modelled, its trainable parameters,
    optimizer, input ids)."""
    import torch

    from fitune.runtime.layers import find_decoder_layers
    from fitune.runtime.model import build_random_model, set_checkpointing

    ckpt_mode = setup.checkpointed_layers_mode  # none | full | selective
    model = _build(build_random_model, hf_config, setup, label, model_type)
    layers = find_decoder_layers(model)
    text_config = model.config.get_text_config()
    setup.validate(num_layers=len(layers) if layers else getattr(text_config, "num_hidden_layers", None),
                   hidden_size=getattr(text_config, "hidden_size", None))
    vocab = int(model.get_input_embeddings().weight.shape[0])
    setup = _peft_default_targets(model, setup, label, model_type, notes)  # the setup modelled from here on
    model = _make_trainable(model, setup, layers, label, model_type)
    if ckpt_mode != "none":
        set_checkpointing(model, True)  # the runner's checkpointing (non-reentrant), as prepare_model sets it
        if ckpt_mode == "selective":
            _checkpoint_first_layers(model, layers, setup.selective_k(), label, model_type)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(f"{label}: the setup trains no parameter (--method {setup.method}); nothing to trace")
    # fitune's one optimizer factory, with foreach, PyTorch's default on CUDA (on CPU it would pick the loop)
    opt = build_optimizer(setup.optimizer, trainable, lr=1e-4, foreach=True)
    ids = torch.randint(0, vocab, (setup.batch_size, setup.seq_len_tokens))
    return model, setup, trainable, opt, ids


class _PhaseRecorder:
    """The tracker's bookkeeping around the phases of fitune's one training step (`phase` is its `phase=` hook):
    each phase's peak, the saved tensors of the last forward, the live bytes around it, the gradients' bytes."""

    def __init__(self, model, trainable: list, ids, setup: TrainSetup, micro_batches: int, fake: bool):
        self.setup, self.micro_batches, self.fake, self.trainable = setup, micro_batches, fake, trainable
        self.param_storage_ids = _storage_keys(model.parameters(), fake)
        self.tracker = make_tracker()
        self.tracker.track(model.parameters(), "params")
        self.tracker.track(model.buffers(), "buffers")
        self.tracker.track([ids], "inputs")
        self.phases: dict[str, tuple[int, dict[str, int]]] = {}
        self.saved_hooks_bytes = 0
        self.start_bytes = self.before_fwd_bytes = self.after_fwd_bytes = 0
        self.grads_bytes = 0
        self.last_step, self.micro, self.fwds, self.bwds, self.optp = False, 0, [], [], None
        self.in_forward = False
        self.kept_outputs: list = []  # keep_outputs: the output held through the backward (logits, KV cache)

    def start_step(self, last_step: bool) -> None:
        self.last_step, self.micro, self.fwds, self.bwds, self.optp = last_step, 0, [], [], None
        self.start_bytes = self.tracker.total

    def end_step(self, opt) -> None:
        self.tracker.retag(_optimizer_tensors(opt), "optimizer")  # the state is still alive
        if self.last_step:
            self.phases = {"forward": max(self.fwds, key=lambda x: x[0]),
                           "backward": max(self.bwds, key=lambda x: x[0]), "optimizer": self.optp}

    def keep_output(self, module, args, output) -> None:
        """A forward hook on the model: keep_outputs holds its output through the backward."""
        if self.setup.keep_outputs and self.in_forward:
            self.kept_outputs.append(output)

    @contextlib.contextmanager
    def phase(self, phase_name: str):
        if phase_name == "forward":
            with self._forward():
                yield
        elif phase_name == "backward":
            self.tracker.start_phase("temporaries")
            yield
            self.kept_outputs.clear()  # the output kept through the backward goes after it
            self.bwds.append(self.tracker.end_phase())
            self.micro += 1
        else:  # optimizer
            if self.last_step:
                self.grads_bytes = _unique_bytes((p.grad for p in self.trainable if p.grad is not None), self.fake)
            self.tracker.start_phase("temporaries")
            yield
            self.optp = self.tracker.end_phase()

    @contextlib.contextmanager
    def _forward(self):
        """A forward; the last step's last one also counts the unique storages autograd saves (hooks)."""
        import torch

        measure = self.last_step and self.micro == self.micro_batches - 1
        self.before_fwd_bytes = self.tracker.total
        self.tracker.start_phase("activations")
        self.in_forward = True
        try:
            if measure:
                seen: dict[Any, int] = {}
                keep: list = []
                with torch.autograd.graph.saved_tensors_hooks(_make_pack(seen, keep, self.fake), _unpack):
                    yield
                self.saved_hooks_bytes = sum(n for k, n in seen.items() if k not in self.param_storage_ids)
                seen.clear()
                keep.clear()  # holding them longer would keep them alive past the backward
            else:
                yield
        finally:
            self.in_forward = False
        self.fwds.append(self.tracker.end_phase())
        self.after_fwd_bytes = self.tracker.total


def _run_steps(model, opt, ids, steps: int, micro_batches: int, rec: _PhaseRecorder, label: str) -> None:
    """`steps` of fitune's one training step, recorded by `rec`; a failure of the model's own code becomes a
    `TraceModelError`."""
    from fitune.runtime.step import train_step

    # a gradient is a temporary of the backward until it is accumulated into .grad
    handles = [
        p.register_post_accumulate_grad_hook(lambda p: rec.tracker.retag([p.grad], "grads")) for p in rec.trainable
    ]
    out_handle = model.register_forward_hook(rec.keep_output)
    try:
        with rec.tracker:
            for step in range(steps):
                rec.start_step(last_step=step == steps - 1)
                train_step(model, opt, [ids] * micro_batches, recipe=True, phase=rec.phase)
                rec.end_step(opt)
    except FituneError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own code on fake tensors
        logger.debug("the trace of %s failed", label, exc_info=True)
        raise TraceModelError(
            f"the trace of {label} failed while running the training step: "
            f"{type(exc).__name__}: {_first_line(exc)}. Some models use data-dependent operations that fake "
            "tensors cannot run; use the analytic engine if it models this architecture"
        ) from exc
    for h in handles:
        h.remove()
    out_handle.remove()


def _state_sizes(model, trainable: list, opt, fake: bool) -> dict[str, int]:
    """The `TraceResult` fields read off the model and the optimizer after the last step."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return dict(
        weights_bytes=_unique_bytes(list(frozen) + list(model.buffers()), fake),
        adapter_weights_bytes=_unique_bytes(trainable, fake),
        optimizer_states_bytes=_unique_bytes(_optimizer_tensors(opt), fake),
        trainable_params=sum(p.numel() for p in trainable),
        frozen_params=sum(p.numel() for p in _unique_tensors(frozen, fake)),
    )


def _saved_activations(setup: TrainSetup, rec: _PhaseRecorder, notes: list) -> int:
    """What autograd keeps from the last forward (module docstring): the saved-tensor hooks' count, or, under
    checkpointing (whose own hooks hide what the layers save), the live bytes after the forward less before it."""
    diff = rec.after_fwd_bytes - rec.before_fwd_bytes
    if setup.checkpointed_layers_mode != "none":
        notes.append(
            f"checkpointed ({setup.grad_checkpointing}): saved_activations_bytes = live bytes after the forward - "
            f"live bytes before it (an outer saved_tensors_hooks sees only {rec.saved_hooks_bytes} bytes outside the "
            "checkpointed layers)"
        )
        return diff
    notes.append(f"live bytes after the forward - before it: {diff} (saved tensors + loss)")
    return rec.saved_hooks_bytes


# ------------------------------------------------------------------------------------- the setup, applied


def _build(build_random_model, hf_config: dict, setup: TrainSetup, label: str, model_type: str):
    """The recipe's `build_random_model`, its failures turned into one message (transformers raises many kinds)."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise TraceModelError(
            f"{label}: transformers {transformers_version} does not know model_type {model_type!r}, so it cannot "
            "build the model; check the config.json's model_type, or install a transformers that has it"
        )
    try:
        return build_random_model(hf_config, attn=setup.attn, device="cpu", dtype_name=setup.dtype)
    except FituneError:
        raise
    except Exception as exc:  # noqa: BLE001 - config validation errors come as ValueError, TypeError, KeyError...
        logger.debug("building %s failed", label, exc_info=True)
        raise TraceModelError(
            f"transformers {transformers_version} cannot build a causal LM (AutoModelForCausalLM.from_config) "
            f"from the config.json of {label} (--attn {setup.attn}): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc


def _make_trainable(model, setup: TrainSetup, layers: list, label: str, model_type: str):
    """The method's trainable parameters, set by the runner's own preparation (`fitune.runtime.model.
    make_trainable`); what it cannot do for this model is said in the trace engine's words."""
    from fitune.runtime.model import make_trainable

    if setup.method == "freeze" and not layers:
        raise TraceUnsupportedError(
            f"--engine trace cannot model --method freeze for {label}: it finds no list of decoder layers "
            "(transformers GradientCheckpointingLayer) in it; use --method lora or full"
        )
    try:
        return make_trainable(model, setup)
    except ValueError as exc:
        if "not found in the base model" in str(exc):
            raise ConfigError(_missing_targets_message(model, setup, label, model_type)) from exc
        raise TraceModelError(f"PEFT cannot add LoRA adapters to {label}: {_first_line(exc)}") from exc


def _peft_default_targets(model, setup: TrainSetup, label: str, model_type: str, notes: list) -> TrainSetup:
    """`setup`, or, when its LoRA targets are fitune's default (q_proj, v_proj: the user named none) and the model
    has none of them, `setup` with PEFT's default targets for the model_type (what `target_modules=None` does).
    Targets the user named are never replaced: missing ones stay an error (`_missing_targets_message`)."""
    if setup.method != "lora" or setup.all_linear:
        return setup
    default = {f.name: f.default for f in dataclasses.fields(TrainSetup)}["lora_targets"]
    if tuple(setup.lora_targets) != tuple(default):
        return setup
    names = _adaptable_module_names(model)
    if any(t in names for t in setup.lora_targets):
        return setup
    peft_default = _peft_default_targets_for(model_type)
    if not peft_default or not all(t in names for t in peft_default):
        return setup  # nothing PEFT would pick either: the missing-targets error names what the model has
    notes.append(f"--lora-targets not given: PEFT's default for {model_type}, {','.join(peft_default)}")
    return setup.replace(lora_targets=tuple(peft_default))


def _peft_default_targets_for(model_type: str) -> list[str] | None:
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults
    except ImportError:  # pragma: no cover - older PEFT
        return None
    default = peft_defaults.get(model_type)
    return list(default) if default else None


def _missing_targets_message(model, setup: TrainSetup, label: str, model_type: str) -> str:
    names = _adaptable_module_names(model)
    default = _peft_default_targets_for(model_type)
    hint = f"; PEFT's default for {model_type} is --lora-targets {','.join(default)}" if default else ""
    return (f"--lora-targets {','.join(setup.lora_targets)}: no such module in {label}; "
            f"its layers have {', '.join(names) or 'no nn.Linear'}{hint} (or use --lora-targets all-linear)")


def _adaptable_module_names(model) -> list[str]:
    """Names (last component) of the Linear / Conv1D modules LoRA can wrap, the output head excluded, in order."""
    import torch

    head = model.get_output_embeddings()  # lm_head, embed_out (GPT-NeoX), ...: not a LoRA target of the recipe
    out: list[str] = []
    for full_name, m in model.named_modules():
        if m is not head and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"):
            short = full_name.rsplit(".", 1)[-1]
            if short not in out:
                out.append(short)
    return out


def _checkpoint_first_layers(model, layers: list, k: int, label: str, model_type: str) -> None:
    """selective:K: keep checkpointing on the first K decoder layers only, as fitune's runner does."""
    if not layers or not all(any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
                             for m in layers):
        raise TraceUnsupportedError(
            f"--engine trace cannot model --grad-checkpointing selective:{k} for {label}: it finds no list of "
            "decoder layers (transformers GradientCheckpointingLayer) in it; use none or full"
        )
    from fitune.runtime.techniques.offload import enable_selective_checkpointing

    enable_selective_checkpointing(model, k)  # the runner's own: checkpointing kept on the first k layers


def _first_line(exc: BaseException, limit: int = 400) -> str:
    """The exception's message on one line, cut at `limit` characters (some list every known model type)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------------------------------------- helpers


def _optimizer_tensors(opt) -> list:
    import torch

    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _storage_key(t, fake: bool):
    """A key that identifies `t`'s storage: the data pointer for real tensors, the storage object's id for fake
    ones (fake storages have no data; PyTorch keeps one Python object per live storage)."""
    st = t.untyped_storage()
    return id(st) if fake else st.data_ptr()


def _unique_tensors(tensors, fake: bool):
    seen = set()
    out = []
    for t in tensors:
        k = _storage_key(t, fake)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def _unique_bytes(tensors, fake: bool) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    seen: dict[Any, int] = {}
    keep = []  # keep the storages alive while counting so that ids are not reused
    for t in tensors:
        st = t.untyped_storage()
        keep.append(st)
        seen[id(st) if fake else st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _storage_keys(tensors, fake: bool) -> set:
    return {_storage_key(t, fake) for t in tensors}


@contextlib.contextmanager
def _no_packed_sequence_detection():
    """Answer transformers' packed-sequence question the way a real run of the recipe does: "not packed".

    Without a KV cache (training with checkpointing sets `use_cache=False`) and without an attention mask,
    `masking_utils.find_packed_sequence_indices(position_ids)` asks the data `(mask[:, -1] == 0).all()`; a real
    run answers "one sequence per row" (position ids are 0..S-1) and lets SDPA use `is_causal` without a mask.
    On fake tensors transformers treats the check as tracing and returns a packed-sequence mask, which would
    materialise a [B, 1, S, S] mask and, for GQA models, `repeat_kv` copies of K and V that the real run never
    makes. The recipe never packs sequences, so answer None here, as the real run does.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - older transformers: nothing to patch
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:  # pragma: no cover
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


def _make_pack(seen: dict, keep: list, fake: bool):
    """A pack hook that records {storage key: nbytes} of every saved tensor into `seen`."""

    def pack(t):
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - sparse or exotic tensors have no storage: counting is best effort
            return t
        if fake:
            keep.append(st)  # ids stay unique during the forward (saved tensors are alive then anyway)
            seen[id(st)] = st.nbytes()
        else:
            seen[st.data_ptr()] = st.nbytes()
        return t

    return pack


def _unpack(t):
    return t


@contextlib.contextmanager
def _fake_swap_fix(mode):
    """Let `nn.Module.to()` work on fake parameters (PEFT moves each new LoRA layer with `.to(device, dtype)`).

    `Module._apply` always swaps FakeTensor parameters with `torch.utils.swap_tensors`, which refuses tensors
    that carry a weakref, and `FakeTensorConverter.from_meta_and_device` memoises every fresh fake tensor in
    a `WeakValueDictionary` (pytorch#178584, pytorch#196558). Dropping the two tensors from that memo before
    the swap is harmless: the memo is a cache keyed by dead meta tensors.
    """
    import torch.utils

    orig = torch.utils.swap_tensors
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def swap_tensors(t1, t2):
        if weakref.getweakrefcount(t1) or weakref.getweakrefcount(t2):
            for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
                memo.pop(key, None)
        return orig(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = orig
