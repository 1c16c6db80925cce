"""Rules about gradient checkpointing: is it on, does it recompute, does it train what it should.

What the installed stack does (transformers 5.17, torch 2.13; line references are to those releases):
- `PreTrainedModel.gradient_checkpointing_enable()` defaults to `use_reentrant=False` and calls
  `enable_input_require_grads()` itself (modeling_utils.py); transformers 4.x defaulted to the reentrant variant.
- `Trainer` calls `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
  args.gradient_checkpointing_kwargs)` when `TrainingArguments(gradient_checkpointing=True)` (trainer.py); nothing
  else reads that flag.
- A layer recomputes only `if self.gradient_checkpointing and self.training` (modeling_layers.py), and
  `from_pretrained` returns the model in eval mode.
- `torch.utils.checkpoint.checkpoint` without `use_reentrant` warns and runs the reentrant variant, which gives no
  gradient to weights inside the block when none of its inputs requires grad.
"""

from __future__ import annotations

from typing import Iterator

from ...specs import load_model_spec
from ...units import gib
from .. import evidence
from ..findings import ERROR, INFO, WARNING
from ..index import Call, ScriptIndex
from .base import Hit, call_text, known_setup, rule

TORCH_CHECKPOINT = ("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential")
RUNTIME_CHECK = ("verified on the CPU by fitune's tests: fitune.doctor.runtime.RunMonitor counts each "
                 "decoder layer's forward calls per step (2 with checkpointing in train mode, 1 in eval mode)")


def _method_enables(ix: ScriptIndex) -> list[Call]:
    return ix.calls_named("gradient_checkpointing_enable")


def _flag_enables(ix: ScriptIndex) -> list[Call]:
    return [c for c in ix.training_args if ix.is_true(c.kw("gradient_checkpointing"))]


def _torch_checkpoints(ix: ScriptIndex) -> list[Call]:
    return [c for c in ix.calls if c.name in TORCH_CHECKPOINT]


def checkpointing_enabled(ix: ScriptIndex) -> bool:
    return bool(_method_enables(ix) or _flag_enables(ix) or _torch_checkpoints(ix))


def _input_grads_enabled(ix: ScriptIndex) -> bool:
    return bool(ix.calls_named("enable_input_require_grads", "prepare_model_for_kbit_training"))


@rule("checkpoint-reentrant", WARNING, "reentrant checkpointing (an error when the checkpointed inputs are frozen)",
      ("C15",))
def checkpoint_reentrant(ix: ScriptIndex) -> Iterator[Hit]:
    frozen = ix.freezes_parameters and not _input_grads_enabled(ix)
    for c in _torch_checkpoints(ix):
        reentrant = c.kw("use_reentrant")
        if reentrant is not None and not ix.is_true(reentrant):
            continue  # use_reentrant=False, or decided at run time
        said = ("use_reentrant=True" if reentrant is not None
                else "no use_reentrant (torch then runs the reentrant variant and warns)")
        if frozen:
            yield Hit(c.line,
                      f"`{call_text(c)}` with {said}, while the inputs to the block do not require grad (frozen "
                      "embeddings, LoRA): the reentrant variant computes no gradient for the weights inside the "
                      "block - backward fails with 'element 0 of tensors does not require grad', or those weights "
                      "silently never change.",
                      "use_reentrant=False", _REENTRANT_EVIDENCE, severity=ERROR)
        else:
            yield Hit(c.line, f"`{call_text(c)}` with {said}: PyTorch recommends the non-reentrant variant, which "
                              "works with inputs that need no grad and stops the recompute early.",
                      "use_reentrant=False", _REENTRANT_EVIDENCE)
    for c in _method_enables(ix) + _flag_enables(ix):
        kwargs = ix.value(c.kw("gradient_checkpointing_kwargs"))
        if not (isinstance(kwargs, dict) and kwargs.get("use_reentrant") is True):
            continue
        yield Hit(c.line,
                  f"`{call_text(c)}` asks for use_reentrant=True. transformers 5 calls enable_input_require_grads() "
                  "for you; transformers 4.x did not, and with frozen inputs (LoRA) the adapters inside each layer "
                  "then got no gradient unless checkpointing was enabled before get_peft_model.",
                  'gradient_checkpointing_kwargs={"use_reentrant": False} (transformers 5\'s default)',
                  _REENTRANT_EVIDENCE)


_REENTRANT_EVIDENCE = ("source: torch/utils/checkpoint.py (torch 2.13): use_reentrant defaults to True when not "
                       "passed, with the warning 'None of the inputs have requires_grad=True. Gradients will be "
                       "None'; checked on the CPU by fitune's tests (a reentrant checkpoint of frozen inputs gives "
                       "no gradient)")


@rule("checkpointing-in-eval-mode", ERROR, "checkpointing enabled but the model is never put in train mode", ("C15",))
def checkpointing_in_eval_mode(ix: ScriptIndex) -> Iterator[Hit]:
    """A plain loop over a from_pretrained model that never calls .train(): no layer recomputes."""
    if ix.uses_trainer or not ix.model_loads or not ix.trains:
        return
    if ix.calls_named("train"):
        return
    for c in _method_enables(ix):
        yield Hit(c.line,
                  f"`{call_text(c)}` has no effect here: from_pretrained returns the model in eval mode, transformers "
                  "recomputes a layer only while model.training is True, and this script never calls "
                  "model.train(). Every activation is kept, as without checkpointing.",
                  "call model.train() before the training loop (Trainer does it for you)",
                  f"source: transformers/modeling_layers.py GradientCheckpointingLayer.__call__ "
                  f"(`if self.gradient_checkpointing and self.training`); {RUNTIME_CHECK}; what checkpointing "
                  f"saves when it runs: {evidence.checkpointing_effect(known_setup(ix))}")


@rule("checkpointing-flag-without-trainer", ERROR, "TrainingArguments(gradient_checkpointing=True) without a Trainer",
      ("C15",))
def checkpointing_flag_without_trainer(ix: ScriptIndex) -> Iterator[Hit]:
    if ix.uses_trainer or _method_enables(ix):
        return
    for c in _flag_enables(ix):
        yield Hit(c.line,
                  f"`{call_text(c)}` sets gradient_checkpointing=True but no Trainer is built: only Trainer reads "
                  "that flag, so this loop trains without checkpointing.",
                  'call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}) '
                  "and model.train() before your loop",
                  f"source: transformers/trainer.py calls model.gradient_checkpointing_enable() when "
                  f"args.gradient_checkpointing; {evidence.checkpointing_effect(known_setup(ix))}")


@rule("checkpointing-flag-and-method", INFO, "checkpointing enabled both on the model and in TrainingArguments",
      ("C15",))
def checkpointing_flag_and_method(ix: ScriptIndex) -> Iterator[Hit]:
    flags = _flag_enables(ix)
    if not (flags and ix.uses_trainer):
        return
    for c in _method_enables(ix):
        own = c.kw("gradient_checkpointing_kwargs") is not None
        flag_kwargs = any(f.kw("gradient_checkpointing_kwargs") is not None for f in flags)
        if own and not flag_kwargs:
            message = (f"`{call_text(c)}` passes its own gradient_checkpointing_kwargs, but TrainingArguments("
                       "gradient_checkpointing=True) makes Trainer call gradient_checkpointing_enable() again with "
                       "args.gradient_checkpointing_kwargs, replacing yours.")
            fix = "move the kwargs into TrainingArguments(gradient_checkpointing_kwargs=...) and drop this call"
        else:
            message = (f"`{call_text(c)}` is redundant: TrainingArguments(gradient_checkpointing=True) already "
                       "makes Trainer enable checkpointing (the model method is not needed in addition).")
            fix = "keep one: the TrainingArguments flag (with gradient_checkpointing_kwargs) is enough"
        yield Hit(c.line, message, fix,
                  "source: transformers/trainer.py: `if args.gradient_checkpointing: "
                  "self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`")


@rule("use-cache-with-checkpointing", INFO, "use_cache not turned off while checkpointing", ())
def use_cache_with_checkpointing(ix: ScriptIndex) -> Iterator[Hit]:
    if not checkpointing_enabled(ix) or not ix.trains:
        return
    turned_off = any(a.target.endswith("use_cache") and ix.is_false(a.value) for a in ix.assignments)
    turned_off = turned_off or any(ix.is_false(c.kw("use_cache")) for c in ix.calls)
    if turned_off:
        return
    explicit_on = [c for c in ix.model_loads if ix.is_true(c.kw("use_cache"))]
    site = explicit_on[0] if explicit_on else (_method_enables(ix) + _flag_enables(ix) + _torch_checkpoints(ix))[0]
    yield Hit(site.line,
              "checkpointing is on but use_cache is never turned off: transformers 5 drops the KV cache inside "
              "checkpointed layers and warns each time; older releases and custom code build a cache of every "
              "layer's keys and values that training never reads.",
              "model.config.use_cache = False (or from_pretrained(..., use_cache=False))",
              "source: transformers/modeling_layers.py GradientCheckpointingLayer.__call__ sets use_cache=False "
              "during training with checkpointing. Reasoned (not measured): the cache holds 2 x layers x batch x "
              f"seq x kv_heads x head_dim values ({_kv_cache_text(ix)})")


def _kv_cache_text(ix: ScriptIndex) -> str:
    """The KV cache's size for this script's model and shape (computed from the catalog config), or the forum case."""
    ss = known_setup(ix)
    if ss is None:
        return "0.50 GiB for llama-3.1-8b at 2x2048 in bf16"
    m, s = load_model_spec(ss.model), ss.setup
    n = 2 * m.num_layers * s.batch_size * s.seq_len_tokens * m.num_kv_heads * m.head_dim * 2
    return f"computed from the catalog config: {gib(n)} for this script's {ss.model} at {s.batch_size}x{s.seq_len_tokens} in bf16"


@rule("torch-compile-with-checkpointing", INFO, "torch.compile together with gradient checkpointing", ("C13",))
def torch_compile_with_checkpointing(ix: ScriptIndex) -> Iterator[Hit]:
    """torch.compile and checkpointing in one script: they work together; what compile changes was measured (C13)."""
    sites = [c for c in ix.calls if c.name in ("torch.compile", "compile") and c.node.args]
    sites += [c for c in ix.calls if c.tail == "compile" and c.receiver in ix.model_variables]
    sites += [c for c in ix.training_args if ix.is_true(c.kw("torch_compile"))]
    if not sites or not (checkpointing_enabled(ix) or ix.calls_named("prepare_model_for_kbit_training")):
        return
    c = sites[0]
    yield Hit(c.line,
              f"`{call_text(c)}` compiles a model that also uses gradient checkpointing. They do not conflict: "
              "measured on an H200, compiled runs with checkpointing trained and were faster. What compile changes "
              "depends on what it compiles: the whole model fuses the loss into the lm_head's output, and the peak "
              "(the logits, with checkpointing) falls; compiling each decoder layer leaves a checkpointed peak as "
              "it is. fitune's estimate models compiled decoder layers (`--stack fitune --compile layers`, fitune's "
              "runner) but not a whole-model compile: with that, expect less than it says. The first step pays the "
              "compilation.",
              "keep both; to check the gain on your model, compare torch.cuda.max_memory_allocated() and tokens/s "
              "of a few steps with and without torch.compile (fitune.doctor.runtime.RunMonitor records peaks)",
              "measured (LoRA r8 q,v, bf16, 2 x 2048, checkpointing): llama-3.2-1b with "
              "torch.compile(model): 8.53 -> 5.66 GiB peak allocated, 32.6k -> 54.8k tokens/s, 59 s to compile; "
              "each layer compiled: 8.53 GiB both, 55.5k tokens/s; llama-3.1-8b, each layer compiled: 21.99 GiB "
              "both, 9.7k -> 11.8k tokens/s (docs/evidence.md C13)")


RULES = (checkpoint_reentrant, checkpointing_in_eval_mode, checkpointing_flag_without_trainer,
         checkpointing_flag_and_method, use_cache_with_checkpointing, torch_compile_with_checkpointing)
