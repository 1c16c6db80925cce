"""`train()`: one readable training loop (not HF Trainer).

    for each optimizer step:
        take grad_accum batches from the stream          # the data of this step, fixed before any compute
        for each micro-batch of them: forward, backward  # loss = sum over tokens / tokens of the whole step
        clip, optimizer step, schedule step
        log a metrics.jsonl line; evaluate / checkpoint when due
    on CUDA out of memory: free the step, re-plan (halve the micro-batch, then checkpoint activations),
        retry the same step with the same data
    on Ctrl-C: write a checkpoint of the last finished step, exit cleanly

Dividing the summed token losses by the step's trained-token count (`num_items_in_batch`) makes the gradient
independent of how the step's data is split into micro-batches: the OOM guard's re-plan changes memory, not
the result.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

from ..errors import FituneError
from ..units import GiB
from . import checkpoint
from .config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """How a step is executed; the OOM guard changes it, the data and the optimizer never notice."""

    micro_batch_size: int
    grad_checkpointing: bool
    changes: list[dict] = field(default_factory=list)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    eval_losses: dict[int, float]
    output_dir: str
    adapter_dir: str | None
    merged_dir: str | None
    plan: Plan
    model: object = None
    """The trained model (in memory), for callers that go on using it."""


class TrainingInterrupted(FituneError):
    exit_code = 130


def train(cfg: TrainConfig, resume: bool = False, fault=None, progress: bool = True) -> TrainResult:
    """Run the training `cfg` describes. `fault(step, micro_index)` may raise to inject failures (tests)."""
    import torch

    from . import data as data_mod
    from .model import (load_model, load_tokenizer, pick_device, prepare_for_method, set_checkpointing,
                        configure_allocator)

    configure_allocator(cfg.setup)  # before CUDA starts
    device = pick_device()
    if cfg.cap and device == "cuda":
        from ..specs.gpu import resolve_gpu

        budget = resolve_gpu(str(cfg.cap)).allocator_budget_bytes
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(0).total_memory))
    _seed_everything(cfg.seed)
    os.makedirs(cfg.output_dir, exist_ok=True)
    tokenizer = load_tokenizer(cfg)
    s = cfg.setup

    # ---- data: tokenised once, batched deterministically -------------------------------------------------
    records = data_mod.read_records(cfg.data.path)
    examples, stats = data_mod.tokenize_records(records, tokenizer, cfg.data.format, s.seq_len_tokens)
    items = data_mod.pack(examples, s.seq_len_tokens) if cfg.packing else examples
    log.info("data: %d examples, %d tokens (%d trained); %d truncated (%d tokens cut); %d without trained tokens",
             stats.examples, stats.tokens, stats.trained_tokens, stats.truncated_examples, stats.truncated_tokens,
             stats.skipped_empty)
    stream = data_mod.BatchStream(items, s.batch_size, cfg.seed, data_mod.pad_id(tokenizer), packed=cfg.packing)
    eval_items = None
    if cfg.data.eval_path:
        ev, _ = data_mod.tokenize_records(data_mod.read_records(cfg.data.eval_path), tokenizer, cfg.data.format,
                                          s.seq_len_tokens)
        eval_items = data_mod.pack(ev, s.seq_len_tokens) if cfg.packing else ev
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * math.ceil(len(items) / s.batch_size) / s.grad_accum))

    # ---- model, optimizer, schedule ------------------------------------------------------------------------
    model = prepare_for_method(load_model(cfg, device), cfg)
    if cfg.packing and cfg.packing_attention == "varlen":
        from .techniques.varlen_attention import enable_varlen_attention

        if enable_varlen_attention(model):
            log.info("packing: examples attended one by one inside each row (no mask tensor)")
        else:
            log.info("packing: this model keeps transformers' block-diagonal mask (sliding window or attention %s)",
                     s.attn)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise FituneError(f"tokenizer {cfg.tokenizer or cfg.model} has {len(tokenizer)} tokens but the model's embedding "
                          f"has {vocab} rows; use the model's own tokenizer")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(cfg, trainable)
    scheduler = _scheduler(cfg, optimizer, total_steps)
    scaler = torch.amp.GradScaler("cuda") if s.dtype == "fp16" and device == "cuda" else None
    plan = Plan(micro_batch_size=s.batch_size, grad_checkpointing=s.grad_checkpointing != "none")
    step = 0
    if resume:
        path = checkpoint.latest(cfg.output_dir)
        if path is None:
            raise FituneError(f"--resume: no complete checkpoint in {cfg.output_dir}/checkpoints; start without --resume")
        state = checkpoint.load(path, model, optimizer, scheduler)
        step = state["step"]
        stream.load_state_dict(state["data"])
        for change in state.get("plan_changes", []):  # keep the re-plans that made the run fit
            plan.micro_batch_size = change["micro_batch_size"]
            if change["grad_checkpointing"] and not plan.grad_checkpointing:
                set_checkpointing(model, True)
            plan.grad_checkpointing = change["grad_checkpointing"]
            plan.changes.append(change)
        log.info("resumed from %s at step %d", path, step)

    metrics = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a", encoding="utf-8")
    bar = _progress_bar(total_steps, step, progress)
    losses: list[float] = []
    eval_losses: dict[int, float] = {}
    stream_before_step = stream.state_dict()
    stop = _GracefulStop()
    try:
        while step < total_steps:
            stream_before_step = stream.state_dict()  # an interrupted step's data is taken again on resume
            batches = [stream.next_batch() for _ in range(s.grad_accum)]  # this step's data, fixed
            t0 = time.perf_counter()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()  # per-step peaks in metrics.jsonl
            loss = _step_with_oom_guard(cfg, model, optimizer, scaler, stream, batches, plan, step, fault, device)
            scheduler.step()
            step += 1
            stream_before_step = stream.state_dict()  # this step is done: its data is consumed
            dt = time.perf_counter() - t0
            tokens = sum(b.tokens for b in batches)
            losses.append(loss)
            line = {"step": step, "loss": loss, "lr": scheduler.get_last_lr()[0], "tokens": tokens,
                    "trained_tokens": sum(b.trained_tokens for b in batches), "tokens_per_s": tokens / dt,
                    "step_time_s": dt, "micro_batch_size": plan.micro_batch_size,
                    "grad_checkpointing": plan.grad_checkpointing,
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved() if device == "cuda" else None}
            if scaler is not None:
                line["loss_scale"] = scaler.get_scale()
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
            bar.update(line)
            if eval_items is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == total_steps):
                eval_losses[step] = _evaluate(model, eval_items, data_mod.pad_id(tokenizer), cfg, device)
                metrics.write(json.dumps({"step": step, "eval_loss": eval_losses[step]}) + "\n")
                metrics.flush()
            if cfg.save_every and (step % cfg.save_every == 0 or step == total_steps):
                _save(cfg, step, model, optimizer, scheduler, stream, plan)
            if stop.requested:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        stream.load_state_dict(stream_before_step)  # the unfinished step's batches are not consumed
        path = _save(cfg, step, model, optimizer, scheduler, stream, plan) if step else None
        bar.close()
        metrics.close()
        print(f"\ninterrupted: {'checkpoint of step %d in %s' % (step, path) if path else 'no step finished'}; "
              "continue with --resume", file=sys.stderr)
        raise TrainingInterrupted(f"interrupted at step {step}" + (f"; resume from {path}" if path else "")) from None
    finally:
        stop.restore()
    bar.close()
    metrics.close()
    adapter_dir, merged_dir = _write_outputs(cfg, model, tokenizer)
    return TrainResult(step, losses, eval_losses, cfg.output_dir, adapter_dir, merged_dir, plan, model=model)


# ---- one optimizer step ----------------------------------------------------------------------------------


def _step_with_oom_guard(cfg, model, optimizer, scaler, stream, batches, plan, step, fault, device) -> float:
    """Run the step; on an out-of-memory error free it, re-plan and run the same data again."""
    from ..profile.oom import is_oom

    while True:
        try:
            return _optimizer_step(cfg, model, optimizer, scaler, stream, batches, plan, step, fault)
        except Exception as exc:  # noqa: BLE001 - only OOM is handled; anything else propagates
            if not (cfg.oom_guard and is_oom(exc)):
                raise
            optimizer.zero_grad(set_to_none=True)  # partial gradients of the failed attempt go
            del exc
            _free_memory(device)
            change = _replan(model, plan, step)
            if change is None:
                raise FituneError(
                    f"out of memory at step {step + 1} even with micro-batch 1 and checkpointing; "
                    "`fitune estimate` with this config shows where the memory goes (shorter seq_len or method: qlora)")
            plan.changes.append(change)
            print(f"\nfitune: out of memory at step {step + 1}: {change['why']}; retrying the step with the same data",
                  file=sys.stderr)


def _optimizer_step(cfg, model, optimizer, scaler, stream, batches, plan, step, fault) -> float:
    import torch

    micro = [m for b in batches for m in stream.split(b, plan.micro_batch_size)]
    num_items = sum(m.trained_tokens for m in micro)  # loss = summed token losses / the step's trained tokens
    total = 0.0
    for i, mb in enumerate(micro):
        if fault is not None:
            fault(step, i)
        loss = _forward_loss(model, mb, num_items, cfg.setup.loss)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.item()
        del loss  # frees the graph's last references before the next micro-batch
    if scaler is not None:
        scaler.unscale_(optimizer)
    if cfg.max_grad_norm:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < before:
            print(f"\nfitune: fp16 overflow at step {step + 1}; loss scale {before:g} -> {scaler.get_scale():g}"
                  + (" (collapsing: use dtype bf16)" if scaler.get_scale() < 1 else ""), file=sys.stderr)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _forward_loss(model, mb, num_items: int, loss_kind: str = "hf"):
    import torch

    device = next(model.parameters()).device
    # use_cache=False: no KV cache in training, and transformers builds the packed-sequence mask (examples kept
    # apart by their restarting position_ids) only when no cache is passed
    kwargs = {"input_ids": mb.input_ids.to(device), "labels": mb.labels.to(device), "use_cache": False,
              "num_items_in_batch": torch.tensor(num_items, device=device)}
    if mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask.to(device)
    if mb.position_ids is not None:
        kwargs["position_ids"] = mb.position_ids.to(device)
    if loss_kind == "chunked":  # never materialise the whole sequence's logits
        from .techniques.chunked_loss import causal_lm_chunked_loss

        return causal_lm_chunked_loss(model, kwargs.pop("input_ids"), kwargs.pop("labels"),
                                      num_items=kwargs.pop("num_items_in_batch"), **kwargs)
    return model(**kwargs).loss


def _replan(model, plan: Plan, step: int) -> dict | None:
    """The next, less memory-hungry way to run a step with the same effective batch."""
    from .model import set_checkpointing

    if plan.micro_batch_size > 1:
        old = plan.micro_batch_size
        plan.micro_batch_size = max(1, old // 2)
        why = f"micro-batch {old} -> {plan.micro_batch_size} (more accumulation, same effective batch)"
    elif not plan.grad_checkpointing:
        set_checkpointing(model, True)
        plan.grad_checkpointing = True
        why = "gradient checkpointing turned on"
    else:
        return None
    return {"step": step + 1, "why": why, "micro_batch_size": plan.micro_batch_size,
            "grad_checkpointing": plan.grad_checkpointing}


def _free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---- pieces --------------------------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def _optimizer(cfg: TrainConfig, params):
    import torch

    name = cfg.setup.optimizer
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=cfg.lr, relative_step=False, scale_parameter=False, weight_decay=cfg.weight_decay)
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise FituneError(f"optimizer: {name} needs bitsandbytes (pip install bitsandbytes) on a CUDA machine") from exc
    cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)


def _evaluate(model, items, pad_token_id: int, cfg: TrainConfig, device: str) -> float:
    """Mean token loss over the eval set (no gradients, so no saved activations)."""
    import torch

    from . import data as data_mod

    stream = data_mod.BatchStream(items, cfg.setup.batch_size, cfg.seed, pad_token_id, packed=cfg.packing, shuffle=False)
    n_batches = math.ceil(len(items) / cfg.setup.batch_size)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(n_batches):
            b = stream.next_batch()
            loss = _forward_loss(model, b, 1, cfg.setup.loss)  # summed token loss (num_items = 1)
            total += loss.item()
            tokens += b.trained_tokens
    if was_training:
        model.train()
    return total / max(1, tokens)


def _save(cfg, step, model, optimizer, scheduler, stream, plan) -> str:
    return checkpoint.save(cfg.output_dir, step, model, optimizer, scheduler, stream.state_dict(),
                           {"plan_changes": plan.changes, "config": cfg.to_dict()})


def _write_outputs(cfg: TrainConfig, model, tokenizer) -> tuple[str | None, str | None]:
    """The adapter as a PEFT folder (safetensors), optionally merged weights; full / freeze: the whole model."""
    adapter_dir = merged_dir = None
    if cfg.setup.method in ("lora", "qlora"):
        adapter_dir = os.path.join(cfg.output_dir, "adapter")
        model.save_pretrained(adapter_dir, safe_serialization=True)
        tokenizer.save_pretrained(adapter_dir)
        if cfg.merge:
            merged_dir = os.path.join(cfg.output_dir, "merged")
            merged = model.merge_and_unload()
            merged.save_pretrained(merged_dir, safe_serialization=True)
            tokenizer.save_pretrained(merged_dir)
    else:
        merged_dir = os.path.join(cfg.output_dir, "model")
        model.save_pretrained(merged_dir, safe_serialization=True)
        tokenizer.save_pretrained(merged_dir)
    return adapter_dir, merged_dir


class _GracefulStop:
    """The first Ctrl-C lets the running step finish (no half-applied optimizer step), the second aborts."""

    def __init__(self):
        import signal
        import threading

        self.requested = False
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nfitune: finishing this step, then writing a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)

    def restore(self):
        if self._old is not None:
            import signal

            signal.signal(signal.SIGINT, self._old)
            self._old = None


class _NoBar:
    def update(self, line):  # noqa: D401
        pass

    def close(self):
        pass


class _Bar:
    """tqdm progress bar with tokens/s, loss and memory."""

    def __init__(self, total, start):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, line):
        post = {"loss": f"{line['loss']:.4f}", "tok/s": f"{line['tokens_per_s']:.0f}"}
        if line.get("peak_allocated_bytes"):
            post["mem"] = f"{line['peak_allocated_bytes'] / GiB:.1f}GiB"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


def _progress_bar(total, start, enabled):
    if not enabled:
        return _NoBar()
    try:
        return _Bar(total, start)
    except ImportError:  # pragma: no cover
        return _NoBar()
