"""The "HF recipe": a plain transformers + PEFT training step, written the way users write it.

This is the stack that `fitune estimate --stack hf` models and that `bench/hf_recipe.py` measures on a GPU
(issue 2, item 7). Every choice below is the library default unless the recipe names it:

* `AutoModelForCausalLM` in bf16 with the requested attention implementation;
* PEFT `get_peft_model(model, LoraConfig(r, lora_alpha=16, target_modules, lora_dropout=0.0,
  task_type="CAUSAL_LM"))` (PEFT keeps the adapter weights in fp32: `autocast_adapter_dtype=True`);
* when checkpointing: `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`
  and `enable_input_require_grads()`;
* `torch.optim.AdamW` over the trainable parameters;
* each step `loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step();
  opt.zero_grad(set_to_none=True)`.

QLoRA: the decoder's `nn.Linear` layers become bitsandbytes `Linear4bit` (NF4, double quantisation, bf16
compute); embeddings and lm_head stay bf16.

Imports torch (and transformers / peft / bitsandbytes) lazily: importing this module costs nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

ALL_LINEAR = "all-linear"


def build_random_model(hf_config: dict, attn: str = "sdpa", device: str = "cuda", dtype_name: str = "bf16"):
    """Build a causal LM from a config.json dict with random weights, directly on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    kwargs = {k: v for k, v in hf_config.items() if k not in ("architectures", "torch_dtype", "model_type", "dtype")}
    config = AutoConfig.for_model(hf_config["model_type"], **kwargs)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.train()
    return model


def quantize_decoder_to_nf4(model) -> int:
    """Replace every `nn.Linear` inside the decoder layers with a bitsandbytes NF4 `Linear4bit` (in place).

    Quantises on the weights' own device (fast on a GPU). Embeddings and lm_head are left as they are.
    Returns the number of layers replaced.
    """
    import bitsandbytes as bnb
    import torch

    replaced = 0
    for layer in _decoder_layers(model):
        for parent_name, parent in list(layer.named_modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=True,
                    quant_type="nf4",
                    device="meta",
                )
                weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=q
                )
                q.weight = weight.to(child.weight.device)  # quantises here, on the GPU
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, child_name, q)
                del child, weight  # the bf16 weight is freed once nothing refers to it
                replaced += 1
    return replaced


def _decoder_layers(model):
    inner = getattr(model, "model", model)
    return inner.layers


def wrap_lora(model, rank: int, targets: list[str] | str, alpha: int = 16):
    """`get_peft_model` exactly as the recipe says."""
    from peft import LoraConfig, get_peft_model

    target_modules = ALL_LINEAR if targets == ALL_LINEAR or targets == [ALL_LINEAR] else list(targets)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def enable_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def disable_checkpointing(model) -> None:
    """Undo `enable_checkpointing` completely.

    transformers' `gradient_checkpointing_enable` already registers an input-requires-grad hook on a PEFT model,
    and the recipe's own `enable_input_require_grads()` registers a second one that replaces the first in
    `_require_grads_hooks`, so `disable_input_require_grads()` leaves one behind. Remove every such hook.
    """
    model.gradient_checkpointing_disable()
    model.disable_input_require_grads()
    embeddings = model.get_input_embeddings()
    for key, hook in list(embeddings._forward_hooks.items()):
        if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
            del embeddings._forward_hooks[key]


@dataclass
class StepPeaks:
    """Measured CUDA allocator counters of one training step, phase by phase (bytes)."""

    step: int
    start_allocated_bytes: int
    forward_peak_allocated_bytes: int
    forward_peak_reserved_bytes: int
    after_forward_allocated_bytes: int
    backward_peak_allocated_bytes: int
    backward_peak_reserved_bytes: int
    after_backward_allocated_bytes: int
    optimizer_peak_allocated_bytes: int
    optimizer_peak_reserved_bytes: int
    after_step_allocated_bytes: int
    step_time_s: float
    saved_tensor_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def count_saved_tensors():
    """A context manager that counts the unique storages autograd saves (parameters excluded)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - sparse or exotic tensors: skip, counting is best effort
            pass
        return t

    ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    return ctx, seen


def run_recipe_steps(model, optimizer, ids, steps: int = 3, count_saved_on_last: bool = True) -> list[StepPeaks]:
    """Run `steps` HF-recipe steps and record the allocator counters of each phase."""
    import torch

    cuda = torch.cuda
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out: list[StepPeaks] = []
    for step in range(steps):
        cuda.synchronize()
        t0 = time.perf_counter()
        start = cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        saved = None
        if count_saved_on_last and step == steps - 1:
            ctx, seen = count_saved_tensors()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
            saved = sum(n for p, n in seen.items() if p not in param_ptrs)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        cuda.synchronize()
        f_peak, f_res, after_f = cuda.max_memory_allocated(), cuda.max_memory_reserved(), cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        loss.backward()
        cuda.synchronize()
        b_peak, b_res, after_b = cuda.max_memory_allocated(), cuda.max_memory_reserved(), cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        cuda.synchronize()
        o_peak, o_res, after_o = cuda.max_memory_allocated(), cuda.max_memory_reserved(), cuda.memory_allocated()
        out.append(
            StepPeaks(
                step=step,
                start_allocated_bytes=start,
                forward_peak_allocated_bytes=f_peak,
                forward_peak_reserved_bytes=f_res,
                after_forward_allocated_bytes=after_f,
                backward_peak_allocated_bytes=b_peak,
                backward_peak_reserved_bytes=b_res,
                after_backward_allocated_bytes=after_b,
                optimizer_peak_allocated_bytes=o_peak,
                optimizer_peak_reserved_bytes=o_res,
                after_step_allocated_bytes=after_o,
                step_time_s=time.perf_counter() - t0,
                saved_tensor_bytes=saved,
            )
        )
    return out
