"""Rules about the training loop itself: cache flushing, evaluation under autograd, losses kept alive."""

from __future__ import annotations

import ast
from typing import Iterator

from ...specs import load_model_spec
from ...units import gib
from .. import evidence
from ..findings import ERROR, WARNING
from ..index import ScriptIndex
from .base import Hit, call_text, known_setup, rule

PER_STEP_FUNCTIONS = ("step", "on_step")
"""A call inside a function whose name contains one of these runs once per step (training_step, on_step_end...)."""
SAFE_SCALARS = ("item", "detach", "tolist", "float", "int")
"""Calls that turn a loss into something that does not keep the autograd graph alive."""


@rule("empty-cache-in-loop", WARNING, "torch.cuda.empty_cache() every step", ("C23",))
def empty_cache_in_loop(ix: ScriptIndex) -> Iterator[Hit]:
    for c in ix.calls:
        if not c.name.endswith("cuda.empty_cache"):
            continue
        if not (c.in_loop or any(w in c.function.lower() for w in PER_STEP_FUNCTIONS)):
            continue
        yield Hit(c.line,
                  f"`{call_text(c)}` runs every step: it hands the allocator's cached, unused blocks back to the "
                  "driver. It frees no live tensor, so the peak is the same, and the next step has to cudaMalloc "
                  "them again (slower, and a synchronisation).",
                  "remove it; if the run is at the limit, free references instead (del outputs, loss.item()) and "
                  "check allocator retries with fitune.doctor.runtime.RunMonitor (num_alloc_retries)",
                  evidence.allocator_flushes_itself() + "; empty_cache() releases only unoccupied cached "
                  "blocks (PyTorch docs, CUDA semantics), never a live tensor")


@rule("eval-without-no-grad", WARNING, "evaluation forward passes outside torch.no_grad()", ())
def eval_without_no_grad(ix: ScriptIndex) -> Iterator[Hit]:
    """`model.eval()` then `model(...)` in the same function, outside no_grad/inference_mode."""
    modes = [c for c in ix.calls if c.tail in ("eval", "train") and c.receiver and not c.node.args]
    for c in ix.calls:
        if c.grad_disabled or not isinstance(c.node.func, (ast.Name, ast.Attribute)):
            continue
        before = [m for m in modes if m.receiver == c.name and m.scope == c.scope and m.line <= c.line]
        if not before or max(before, key=lambda m: m.line).tail != "eval":
            continue
        yield Hit(c.line,
                  f"`{call_text(c)}` runs after {c.name}.eval() without torch.no_grad(): eval() only switches "
                  "dropout off; autograd still records the graph and keeps every activation a backward would need, "
                  "so evaluation peaks as high as a training forward.",
                  "wrap evaluation in `with torch.inference_mode():` (or torch.no_grad(), or decorate the function)",
                  "reasoned (not measured): autograd saves tensors for backward whenever grad mode is on and an "
                  "input requires grad (PyTorch docs, autograd mechanics: locally disabling gradient computation)")


@rule("loss-kept-with-graph", WARNING, "a loss tensor accumulated or stored across steps")
def loss_kept_with_graph(ix: ScriptIndex) -> Iterator[Hit]:
    """`total_loss += loss` / `losses.append(loss)` in the loop keeps every step's graph (a leak)."""
    backwarded = {c.receiver for c in ix.calls if c.tail == "backward"}
    for a in ix.assignments:
        if a.augmented and a.in_loop and not a.grad_disabled and a.target not in backwarded:
            if _is_live_loss(ix, a.value, a.scope) and ix.dotted(a.value) != a.target:
                yield _hit(a.line, f"`{a.target} += {ast.unparse(a.value)}`")
    for c in ix.calls_named("append"):
        if c.in_loop and not c.grad_disabled and c.node.args and _is_live_loss(ix, c.node.args[0], c.scope):
            yield _hit(c.line, f"`{ast.unparse(c.node)}`")


def _hit(line: int, what: str) -> Hit:
    return Hit(line,
               f"{what} keeps the loss tensor, and through it the autograd graph of its step (every activation it "
               "saved), alive across steps: memory grows step after step.",
               "accumulate a number: loss.item() (or loss.detach())",
               "reasoned (not measured): a tensor that requires grad references its grad_fn and the tensors it saved; "
               "fitune.doctor.runtime.RunMonitor flags memory that grows every step in a live run")


def _is_live_loss(ix: ScriptIndex, node: ast.AST, scope: int) -> bool:
    """A loss tensor still attached to its graph: `outputs.loss`, or a name holding one (not `loss.item()`)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "loss"
    if isinstance(node, ast.Name) and "loss" in node.id.lower():
        sources = ix.assignments_to(node.id, scope)
        return bool(sources) and not any(_is_scalar(ix, s.value) for s in sources)
    return False


def _is_scalar(ix: ScriptIndex, node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return ix.dotted(node.func).rsplit(".", 1)[-1] in SAFE_SCALARS
    return isinstance(node, ast.Constant)


@rule("outputs-kept-through-backward", WARNING, "the model output (its logits) kept alive through backward")
def outputs_kept_through_backward(ix: ScriptIndex) -> Iterator[Hit]:
    """`out = model(**batch); out.loss.backward()`: `out` still holds the logits while backward runs."""
    try:
        ss = ix.script_setup
    except Exception:  # noqa: BLE001 - an unusual script must not stop the rules
        return
    rec = ss.fields["keep_outputs"]
    if rec.origin != "script" or rec.value is not True:
        return
    s, m = ss.setup, load_model_spec(ss.model)
    logits = s.batch_size * s.seq_len_tokens * m.vocab_size * 2
    where = "" if ss.model_known else f" (the script's model is not in fitune's catalog: quoted for {ss.model})"
    back = ss.anchors.get("backward", rec.lines[-1])
    yield Hit(back,
              f"{rec.why}: the bf16 logits ({s.batch_size} x {s.seq_len_tokens} x {m.vocab_size:,} x 2 bytes = "
              f"{gib(logits)} on {ss.model}{where}) stay allocated through the whole backward, on top of the fp32 "
              "copies the loss makes, at the step's peak.",
              "keep only the loss: `loss = model(**batch).loss`, or `loss = out.loss; del out` before "
              "loss.backward() (log loss.item())",
              evidence.live(ss, {"keep_outputs": False}, "with the output freed before backward",
                            {"keep_outputs": True}, "as written"))


@rule("eval-without-train", WARNING, "model.eval() in the training loop with no model.train() after it")
def eval_without_train(ix: ScriptIndex) -> Iterator[Hit]:
    """An evaluation inside the loop leaves the model in eval mode for every later step: dropout (LoRA's too) is
    off, and gradient checkpointing stops recomputing (transformers checks `self.training`)."""
    if ix.uses_trainer:
        return  # Trainer calls model.train() at every training step
    modes = [c for c in ix.calls if c.tail in ("eval", "train") and not c.node.args and c.receiver
             and c.receiver in ix.model_variables]
    trains = [c for c in modes if c.tail == "train"]
    if not trains:
        return  # never in train mode at all: checkpointing-in-eval-mode says so
    for e in (c for c in modes if c.tail == "eval"):
        if e.in_loop:
            callers = [e]
        else:
            if not e.function or any(t.scope == e.scope and t.line > e.line for t in trains):
                continue  # module level, or the evaluation function restores train mode itself
            callers = [c for c in ix.calls if c.tail == e.function and c.in_loop]
        for caller in callers:
            if any(t.scope == caller.scope and t.in_loop for t in trains):
                continue
            ckpt = ix.calls_named("gradient_checkpointing_enable", "prepare_model_for_kbit_training")
            ss = known_setup(ix)
            cost = (" and gradient checkpointing stops recomputing: every later step keeps every layer's "
                    "activations (the first steps fit; the first step after an evaluation runs out of memory)"
                    if ckpt else "")
            yield Hit(e.line,
                      f"`{e.receiver}.eval()` runs inside the training loop"
                      + (f" (through {e.function}(), called at line {caller.line})" if caller is not e else "")
                      + f" and nothing calls {e.receiver}.train() after it: every later training step runs in "
                      f"eval mode - dropout (LoRA's too) is off{cost}.",
                      f"call {e.receiver}.train() after the evaluation (at the end of {e.function or 'it'}(), or at "
                      "the top of each training step)",
                      "source: transformers/modeling_layers.py GradientCheckpointingLayer.__call__ recomputes only "
                      "`if self.gradient_checkpointing and self.training`; torch.nn.Dropout is the identity in eval "
                      "mode; " + (evidence.checkpointing_effect(ss) if ckpt else "reasoned (not measured)"),
                      severity=ERROR if ckpt else None)
            break


@rule("compiled-model-into-trainer", ERROR, "a torch.compile'd model handed to the Trainer")
def compiled_model_into_trainer(ix: ScriptIndex) -> Iterator[Hit]:
    """`model = torch.compile(model)` then `Trainer(model=model)`: the Trainer reads the columns to keep from
    `model.forward`'s signature, which a compiled module's wrapper shows as `(*args, **kwargs)`; with
    `remove_unused_columns` (the default) every column is dropped and the first step raises."""
    compiled = {a.target: a for a in ix.assignments
                if isinstance(a.value, ast.Call) and ix.dotted(a.value.func) in ("torch.compile", "compile")}
    if not compiled:
        return
    for c in ix.trainer_calls:
        arg = c.kw("model") if c.kw("model") is not None else c.arg(0)
        if not isinstance(arg, ast.Name) or arg.id not in compiled:
            continue
        if any(ix.is_false(t.kw("remove_unused_columns")) for t in ix.training_args):
            continue
        a = compiled[arg.id]
        yield Hit(a.line,
                  f"`{arg.id}` is a torch.compile'd module handed to `{call_text(c)}` (line {c.line}). The Trainer "
                  "keeps only the dataset columns `model.forward` names, and a compiled module's forward is "
                  "`(*args, **kwargs)`: every column is removed and training stops at its first step with "
                  "\"No columns in the dataset match the model's forward method signature\".",
                  "let the Trainer compile: drop this line and pass torch_compile=True to TrainingArguments (or "
                  "keep it and set remove_unused_columns=False)",
                  "measured: a forum script with this line (Mistral QLoRA, the HF Trainer) run as written on the "
                  "H200 (transformers 5.17) stopped with that ValueError before its first step "
                  "(fitune's doctor measurements: docs/evidence.md)")
        return


RULES = (empty_cache_in_loop, eval_without_no_grad, loss_kept_with_graph, outputs_kept_through_backward,
         eval_without_train, compiled_model_into_trainer)
