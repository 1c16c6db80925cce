"""Rules about the training loop itself: cache flushing, evaluation under autograd, losses kept alive."""

from __future__ import annotations

import ast
from typing import Iterator

from .. import evidence
from ..findings import WARNING
from ..index import ScriptIndex
from .base import Hit, call_text, rule

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


RULES = (empty_cache_in_loop, eval_without_no_grad, loss_kept_with_graph)
