"""A miniature autograd over the memory tape: tensors are sizes, ops record what they save and what their
backward allocates. `fitune.memory.layers` writes a decoder layer with these ops; `estimate.py` runs the
forward, then `backward()` replays the recorded ops in reverse, as PyTorch's engine does.

Rules (PyTorch's, simplified):
- an op's output requires grad when any input does (or the op has a trainable parameter);
- autograd saves only what the backward of a *required* gradient needs (derivatives.yaml + codegen guards), so
  a frozen Linear saves its weight only, and the input only when the weight is trainable;
- a saved tensor lives until its op's backward ran; an unsaved intermediate dies when the Python code drops it
  (the builders free them where the modelling code's variables go out of scope);
- in backward, an op allocates the gradients of its inputs that require grad, frees the gradient of its output
  and then its saved tensors; gradients of one tensor arriving from two consumers are summed into the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .tape import ACTIVATIONS, BACKWARD, GRADIENTS, LOGITS, TRANSIENTS, Tape


@dataclass
class Tensor:
    """A tensor on the tape: its id, its bytes, whether autograd tracks it."""

    tid: int
    nbytes: int
    requires_grad: bool
    label: str = ""
    category: str = TRANSIENTS


@dataclass
class _Node:
    """The backward of one op: output -> inputs, with what it frees and allocates on the way."""

    output: Tensor | None
    inputs: list[Tensor]
    saved: list[Tensor]
    grad_bytes: list[int]  # bytes of each input's gradient (same order as inputs)
    extra_bytes: int | tuple[int, ...] = 0  # transient workspace(s) of the backward kernel itself
    param_grad_bytes: int = 0  # gradient of a trainable parameter (stays until zero_grad)
    label: str = ""
    custom: Callable[["Autograd", Tensor | None], None] | None = None
    passthrough: bool = False  # the output's gradient is handed to the inputs as is (add, views)
    grads_last: bool = False  # the kernel frees its incoming gradient and saved tensors before writing the input's


@dataclass
class Autograd:
    tape: Tape
    nodes: list[_Node] = field(default_factory=list)
    _saved_refs: dict[int, int] = field(default_factory=dict)
    _grads: dict[int, Tensor] = field(default_factory=dict)
    param_grads: list[int] = field(default_factory=list)
    _grad_refs: dict[int, int] = field(default_factory=dict)
    keep_saved: bool = True
    """False inside a checkpointed forward: the pack hook drops what autograd would save."""
    retag_saved: bool = True
    """False in a checkpointed layer's recomputation: what it saves lives only through that layer's backward."""
    _on_return: list = field(default_factory=list)
    forward_end: list = field(default_factory=list)
    """Tensors Python holds until the model's forward returns (e.g. the KV cache); freed by the caller."""
    _held: set = field(default_factory=set)
    """Ids of tensors Python still references after autograd is done with them (`hold`)."""

    # ---- forward side ---------------------------------------------------------------------------------
    def new(self, nbytes: int, requires_grad: bool, label: str, category: str = TRANSIENTS) -> Tensor:
        return Tensor(self.tape.alloc(nbytes, category, label), int(nbytes), requires_grad, label, category)

    def defer_until_return(self, *tensors: Tensor) -> None:
        """Locals of a module that die when it returns (`drop_returned`)."""
        self._on_return.extend(tensors)

    def drop_returned(self) -> None:
        self.drop(*self._on_return)
        self._on_return.clear()

    def defer_until_forward_end(self, *tensors: Tensor) -> None:
        self.forward_end.extend(tensors)

    def drop(self, *tensors: Tensor | None) -> None:
        """Python drops its reference: free unless autograd saved the tensor (or Python `hold`s it elsewhere)."""
        for t in tensors:
            if t is not None and t.tid not in self._held and self._saved_refs.get(t.tid, 0) == 0:
                self.tape.free(t.tid)

    def hold(self, *tensors: Tensor | None) -> None:
        """Python keeps these alive past their last use (a script's `out` kept through backward): backward
        releasing what it saved does not free them; `release_held` does."""
        self._held.update(t.tid for t in tensors if t is not None)

    def release_held(self) -> None:
        for tid in sorted(self._held):
            if self._saved_refs.get(tid, 0) <= 0:
                self.tape.free(tid)
        self._held.clear()

    def record(self, output: Tensor | None, inputs: list[Tensor], saved: list[Tensor], grad_bytes: list[int] | None = None,
               extra_bytes: int | tuple[int, ...] = 0, param_grad_bytes: int = 0, label: str = "",
               grads_last: bool = False) -> None:
        """Record the backward of an op whose output is `output` (when anything requires grad)."""
        if not any(t.requires_grad for t in inputs) and not param_grad_bytes:
            return
        if not self.keep_saved:
            saved = []
        for t in saved:
            self._saved_refs[t.tid] = self._saved_refs.get(t.tid, 0) + 1
            if self.retag_saved and self.tape.category_of(t.tid) == TRANSIENTS:
                self.tape.retag(t.tid, ACTIVATIONS)
        gb = grad_bytes if grad_bytes is not None else [t.nbytes for t in inputs]
        self.nodes.append(_Node(output, inputs, saved, gb, extra_bytes, param_grad_bytes, label, grads_last=grads_last))

    def record_passthrough(self, output: Tensor, inputs: list[Tensor], label: str = "") -> None:
        """An op whose backward hands its output's gradient to every input unchanged (add, reshape)."""
        if any(t.requires_grad for t in inputs):
            self.nodes.append(_Node(output, inputs, [], [], label=label, passthrough=True))

    def save_only(self, saved: list[Tensor], label: str = "") -> None:
        """Keep tensors alive until backward reaches this point (e.g. checkpoint inputs)."""
        if not self.keep_saved:
            return
        for t in saved:
            self._saved_refs[t.tid] = self._saved_refs.get(t.tid, 0) + 1
            if self.tape.category_of(t.tid) == TRANSIENTS:
                self.tape.retag(t.tid, ACTIVATIONS)
        self.nodes.append(_Node(None, [], saved, [], label=label))

    def custom(self, fn: Callable[["Autograd", Tensor | None], None], output: Tensor | None, label: str = "") -> None:
        """A backward step written by hand (recomputation of a checkpointed layer, the loss...)."""
        self.nodes.append(_Node(output, [], [], [], label=label, custom=fn))

    # ---- backward side --------------------------------------------------------------------------------
    def seed_grad(self, t: Tensor, nbytes: int, label: str) -> None:
        g = self.new(nbytes, True, label, t.category)
        self._grads[t.tid] = g
        self._grad_refs[g.tid] = 1

    def take_grad(self, t: Tensor | None) -> Tensor | None:
        return self._grads.pop(t.tid, None) if t is not None else None

    def drop_grad(self, g: Tensor | None) -> None:
        if g is None:
            return
        n = self._grad_refs.get(g.tid, 1) - 1
        self._grad_refs[g.tid] = n
        if n <= 0:
            self.tape.free(g.tid)

    def give_grad(self, t: Tensor, nbytes: int, label: str, share: Tensor | None = None) -> None:
        """Deliver a gradient for `t`: allocate it (or share `share`), summed into an earlier one if any."""
        prev = self._grads.get(t.tid)
        if share is not None and prev is None:
            self._grads[t.tid] = share
            self._grad_refs[share.tid] = self._grad_refs.get(share.tid, 1) + 1
            return
        g = self.new(nbytes, True, label, LOGITS if t.category == LOGITS else TRANSIENTS)
        if prev is None:
            self._grads[t.tid] = g
            self._grad_refs[g.tid] = 1
        else:
            self.tape.free(g.tid)  # summed in place into the first buffer

    def release_saved(self, saved: list[Tensor]) -> None:
        for t in saved:
            n = self._saved_refs.get(t.tid, 0) - 1
            self._saved_refs[t.tid] = n
            if n <= 0 and t.tid not in self._held:
                self.tape.free(t.tid)

    def backward(self) -> None:
        self.tape.phase = BACKWARD
        for node in reversed(self.nodes):
            if node.custom is not None:
                node.custom(self, node.output)
                continue
            g_out = self.take_grad(node.output) if node.output is not None else None
            if node.output is not None and g_out is None and not node.param_grad_bytes:
                self.release_saved(node.saved)
                continue
            if node.passthrough:
                for t in node.inputs:
                    if t.requires_grad and g_out is not None:
                        self.give_grad(t, g_out.nbytes, f"grad:{t.label}", share=g_out)
                self.drop_grad(g_out)
                continue
            sizes = node.extra_bytes if isinstance(node.extra_bytes, tuple) else (node.extra_bytes,)
            extra = [self.tape.alloc(n, TRANSIENTS, node.label + ":bwd") for n in sizes if n]
            if node.param_grad_bytes:
                self.param_grads.append(self.tape.alloc(node.param_grad_bytes, GRADIENTS, node.label + ":param-grad"))
            if node.grads_last:  # e.g. softmax's backward: its fp32 result is cast into the input's gradient last
                self.drop_grad(g_out)
                self.release_saved(node.saved)
            for t, gb in zip(node.inputs, node.grad_bytes):
                if t.requires_grad and gb:
                    self.give_grad(t, gb, f"grad:{t.label}")
            self.tape.free(*extra)
            if not node.grads_last:
                self.drop_grad(g_out)
                self.release_saved(node.saved)

