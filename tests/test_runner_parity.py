"""fitune's runner trains what a plain transformers + PEFT loop trains: every technique, on the real model.

Each case runs `fitune.train.loop.train(cfg)` (the user path: a config, a chat data file, metrics.jsonl and the
saved adapter) on SmolLM2-135M-Instruct in fp32 for STEPS steps, and the same steps through a reference loop
written here with transformers, PEFT and torch only:

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(...), LoraConfig(...))
    for each step:  logits = model(input_ids, attention_mask).logits
                    loss = cross_entropy(shifted, reduction="sum") / the step's predicted tokens
                    backward; clip_grad_norm_; AdamW step (lr from the cosine-with-warm-up formula below)

Compared: the loss of every step (relative difference <= LOSS_RTOL), the clipped gradients of the first step
(every trainable gradient of the runner non-zero where the reference's is, cosine >= COSINE_MIN), and the saved
adapter against the reference's final adapter (cosine >= COSINE_MIN per tensor, over all tensors flattened, and
over the adapters' change from their common initial value).

The batches. The data pipeline is not what is under test here (tests/test_data_pipeline.py and test_data_parity.py
test it): the reference takes the *items* the runner's stream yields - token ids and labels of each example, or of
each packed row - from fitune.data (read, tokenize, pack, BatchStream with the run's seed, as fitune/train/loop.py
builds it), and makes its tensors itself: its own right padding, attention mask and label shift; no position ids,
no packed rows. A packed row is split back into its examples, and the reference runs each example as its own
padded row (labels -100 on padding): what packing must equal. That the runner consumed these very batches is
checked from its metrics.jsonl: each step's tokens and trained tokens.

The tiles. At 2 x 64 tokens, fitune's default tiles (chunked loss 1,024 tokens, tiled MLP 2,048, lean RMSNorm
8,192) would each hold the whole step: the tiled MLP would not even run its own code (one tile runs the plain MLP).
The techniques are installed with small tiles here (TILE_TOKENS) so every one of them splits the step.

The cases. Every technique of the runner that runs on a CPU, q_proj,v_proj r8 (one case all-linear), and each
case checks the runner installed what its config asks (the techniques' `enable_*` called, the chunked loss run
every step, checkpointing and the attention implementation as configured). Techniques that touch different parts
of the step share a run, to keep the file near 4 minutes on an idle 2-core CPU (measured: 590 s with the machine
shared with other jobs, load average 6 to 10). Not here: `kernels: liger`, `compile: layers` and QLoRA need CUDA
(bench/train_parity.py runs them on the GPU, bf16, with the same comparison).

The first steps' adapters start equal: the runner seeds torch with the run's seed before building the model, and
the reference does the same before `get_peft_model` draws LoRA's A. (B starts at zero, so step 1's loss does not
depend on A; every later step's does.)
"""

from __future__ import annotations

import functools
import json
import math
import os
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

pytestmark = pytest.mark.slow

STEPS = 20
SEQ_LEN = 64
BATCH = 2
SEED = 0
LR = 1e-3
WARMUP = 2
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
LOSS_RTOL = 1e-4
"""Per-step relative loss difference allowed. fp32 throughout: a technique reorders sums (tiles, chunks,
segment-wise attention), which moves a loss by 1e-7 to 2e-6 relative at step 1 (the chunked loss: its own
log-sum-exp over 49,152 logits, 2e-6); AdamW then carries that forward
(its update m / sqrt(v) is about +-lr for every element, so an element whose gradient is tiny moves by lr whatever
the rounding of that gradient). Measured here (largest over the 20 steps): the runner without techniques 1.0e-7,
lean LoRA 1.0e-7, tiled MLP with offloaded checkpoints 1.0e-7, selective checkpoints 1.0e-7, offloaded embeddings
1.0e-7, lean RMSNorm with full checkpoints 1.4e-6, packing varlen 1.2e-6, packing with the mask 1.9e-6, the chunked
loss 3.0e-5, all-linear with every kernel technique 3.4e-5. A wrong mask, a dropped token, a wrong normalisation or
a missing gradient moves it by 1e-2 and more from the first steps."""
COSINE_MIN = 0.999
TILE_TOKENS = 16
"""Tile / chunk length the techniques run with here: a step of 2 x 64 tokens is several tiles."""

QA = [
    ("Capital of France?", "Paris."),
    ("Name a primary colour.", "Red."),
    ("How many legs does a spider have?", "Eight."),
    ("Translate 'thank you' into Spanish.", "Gracias."),
    ("What is 7 times 6?", "42."),
    ("A synonym for happy?", "Cheerful."),
    ("Which planet is known as the red planet?", "Mars, for the iron oxide on its surface."),
    ("What gas do plants take in?", "Carbon dioxide, which they turn into sugar."),
    ("Who wrote Hamlet?", "William Shakespeare, around 1600."),
    ("Boiling point of water at sea level?", "100 degrees Celsius, or 212 Fahrenheit."),
    ("Say hello.", "Hello!"),
    ("Is the sun a star?", "Yes, a medium-sized one."),
    ("What does a thermometer measure?", "Temperature."),
    ("Days in a leap year?", "366."),
    ("Name an animal that can fly.", "An eagle."),
    ("Opposite of cold?", "Hot."),
    ("Why is the sky blue?", "Air scatters blue sunlight the most."),
    ("What language is spoken in Brazil?", "Portuguese."),
    ("How do you make tea?", "Pour boiling water over a tea bag and wait three minutes."),
    ("Largest ocean?", "The Pacific."),
    ("Count to five.", "One, two, three, four, five."),
    ("Square root of 81?", "Nine."),
    ("Which metal is liquid at room temperature?", "Mercury."),
    ("A yellow fruit?", "A banana."),
    ("What do bees make?", "Honey."),
    ("How many continents are there?", "Seven."),
    ("What is H2O?", "Water: two hydrogen atoms and one oxygen atom."),
    ("Spell cat backwards.", "tac"),
    ("What colour is grass?", "Green."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci."),
]
SYSTEMS = ("Answer briefly.", "Be concise.", "You are a helpful tutor who answers in one short sentence.")


def write_chat_data(path: str) -> str:
    """Short chat records of varied length (about 20 to 45 tokens with SmolLM2's ChatML template)."""
    with open(path, "w") as f:
        for i, (question, answer) in enumerate(QA):
            messages = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                        {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


# ---- the cases --------------------------------------------------------------------------------------------

QV = ["q_proj", "v_proj"]
CASES = {
    # name: (config keys over the base config, the reference's batch stream). Techniques that touch different parts
    # of the step share a run (the file's time budget); each one's code runs in at least one case.
    "plain": ({}, "rows"),
    "loss_chunked": ({"loss": "chunked"}, "rows"),
    "lean_lora": ({"lean_lora": True}, "rows"),
    "lean_norm+ckpt_full": ({"lean_norm": True, "grad_checkpointing": "full"}, "rows"),
    # tiled MLP inside offloaded checkpoints: its no-grad forward, then the recomputation's tiled backward
    "tiled_mlp+ckpt_offload": ({"tiled_mlp": True, "grad_checkpointing": "offload"}, "rows"),
    "ckpt_selective": ({"grad_checkpointing": "selective:12"}, "rows"),
    "offload_embeddings": ({"offload_embeddings": True}, "rows"),
    "packing_varlen": ({"packing": True, "packing_attention": "varlen"}, "packed"),
    "packing_mask": ({"packing": True, "packing_attention": "mask"}, "packed"),
    # all-linear: LoRA inside the tiled MLP's Function (its parameters' gradients), the lean branch on every linear
    "all_linear+chunked+lean_lora+lean_norm+tiled_mlp": (
        {"lora": {"rank": 8, "alpha": 16, "targets": "all-linear"}, "loss": "chunked", "lean_lora": True,
         "lean_norm": True, "tiled_mlp": True}, "rows_all_linear"),
}
STREAMS = {"rows": (False, QV), "packed": (True, QV), "rows_all_linear": (False, "all-linear")}
"""Reference batch streams: (packing, LoRA targets). One reference run each, shared by its cases."""


# ---- the reference loop: transformers + PEFT + torch, no fitune runtime code --------------------------------


def lr_at(step: int) -> float:
    """The learning rate of step `step` (0-based): linear warm-up over WARMUP steps, then half a cosine to 0 at
    STEPS (the schedule of transformers' get_cosine_schedule_with_warmup, written out)."""
    if step < WARMUP:
        return LR * step / max(1, WARMUP)
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def _examples_of(item) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each example in a stream item: an Example, or each example of a packed row."""
    ids, labels = list(item.input_ids), list(item.labels)
    starts = list(getattr(item, "boundaries", (0,)))
    ends = starts[1:] + [len(ids)]
    return [(ids[a:b], labels[a:b]) for a, b in zip(starts, ends)]


def _padded(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (input_ids, attention_mask, labels) of one row per example; labels -100 on padding."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, (x, y) in enumerate(examples):
        ids[r, :len(x)] = torch.tensor(x)
        mask[r, :len(x)] = 1
        labels[r, :len(y)] = torch.tensor(y)
    return ids, mask, labels


def stream_steps(model_dir: str, data_path: str, packing: bool) -> tuple[list[list], int]:
    """The items of each step's batch, as fitune's runner takes them (see the module docstring)."""
    from fitune import data as data_mod
    from fitune.runtime.model import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    examples, _ = data_mod.tokenize_records(data_mod.read_records(data_path), tokenizer, "chat", SEQ_LEN)
    items = data_mod.pack(examples, SEQ_LEN) if packing else examples
    stream = data_mod.BatchStream(items, BATCH, SEED, data_mod.pad_id(tokenizer), packed=packing)
    return [list(stream.next_batch().items) for _ in range(STEPS)], data_mod.pad_id(tokenizer)


def reference_run(model_dir: str, data_path: str, packing: bool, targets) -> dict:
    """The plain loop over the runner's batches: per-step loss, tokens, trained tokens, first-step gradients,
    initial and final adapters."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    steps, pad_id = stream_steps(model_dir, data_path, packing)
    random.seed(SEED)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    initial = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    out = {"loss": [], "tokens": [], "trained_tokens": [], "lr": [], "first_grads": None}
    for step, items in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        examples = [e for item in items for e in _examples_of(item)]
        ids, mask, labels = _padded(examples, pad_id)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        predicted = labels[:, 1:]  # position t predicts token t + 1
        n_trained = int((predicted != -100).sum())
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 predicted.reshape(-1), ignore_index=-100,
                                                 reduction="sum") / n_trained
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        if step == 0:
            out["first_grads"] = {n: p.grad.detach().clone() for n, p in named}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
        out["tokens"].append(int(mask.sum()))
        out["trained_tokens"].append(n_trained)
        out["lr"].append(lr_at(step + 1))  # what metrics.jsonl logs: the rate after the step's schedule step
    out["initial"] = initial
    out["final"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return out


# ---- fitune's runner, through its user path ------------------------------------------------------------------


def untied_copy(model_dir: str, folder: str) -> str:
    """The real model with its lm_head as its own tensor (equal values): offloaded embeddings refuse a tied table.
    With the embeddings and lm_head frozen, the training is the tied model's exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return folder


def run_fitune(monkeypatch, model_dir: str, data_path: str, out_dir: str, over: dict, tokenizer: str | None = None):
    """`train(cfg)` on the data file; its metrics.jsonl lines, saved adapter and first-step gradients (clipped, as
    the optimizer sees them: read by a step pre-hook on the optimizer the runner builds - observation only)."""
    from safetensors.torch import load_file

    from fitune.config import config_from_dict
    from fitune.runtime import optim
    from fitune.runtime.techniques import (chunked_loss, lean_lora, lean_norm, offload, offload_embeddings, tiled_mlp,
                                           varlen_attention)
    from fitune.train.loop import train

    installed: dict[str, int] = {}

    def recorded(module, name, **kwargs):
        """`module.name` with `kwargs`, counting its calls (the runner imports it from the module when it runs)."""
        real = getattr(module, name)

        def call(*args, **kw):
            installed[name] = installed.get(name, 0) + 1
            return real(*args, **{**kwargs, **kw})

        monkeypatch.setattr(module, name, call)

    recorded(tiled_mlp, "enable_tiled_mlp", tile_tokens=TILE_TOKENS)
    recorded(lean_norm, "enable_lean_norm", tile_tokens=TILE_TOKENS)
    recorded(chunked_loss, "causal_lm_chunked_loss", chunk_tokens=TILE_TOKENS)
    recorded(lean_lora, "enable_lean_lora")
    recorded(offload, "enable_offloaded_checkpointing")
    recorded(offload, "enable_selective_checkpointing")
    recorded(offload_embeddings, "enable_offloaded_embeddings")
    recorded(varlen_attention, "enable_varlen_attention")
    first_grads: dict[int, torch.Tensor] = {}

    def build_optimizer(*args, **kwargs):
        opt = real_build(*args, **kwargs)

        def record(optimizer, *_):
            if not first_grads:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        first_grads[id(p)] = p.grad.detach().clone() if p.grad is not None else None

        opt.register_step_pre_hook(record)
        return opt

    real_build = optim.build_optimizer
    monkeypatch.setattr(optim, "build_optimizer", build_optimizer)
    doc = {"model": model_dir, "data": {"path": data_path, "format": "chat"}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": QV}, "dtype": "fp32", "attn": "sdpa",
           "seq_len": SEQ_LEN, "batch_size": BATCH, "grad_accum": 1, "max_steps": STEPS, "lr": LR,
           "weight_decay": WEIGHT_DECAY, "schedule": "cosine", "warmup_steps": WARMUP,
           "max_grad_norm": MAX_GRAD_NORM, "seed": SEED, "stack": "fitune", "output_dir": out_dir,
           "save_every_minutes": None}
    if tokenizer:
        doc["tokenizer"] = tokenizer
    doc.update(over)
    result = train(config_from_dict(doc, "test"), progress=False)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    lines = [line for line in lines if "loss" in line]
    names = {id(p): n for n, p in result.model.named_parameters()}
    base = result.model.get_base_model()
    installed["gradient_checkpointing"] = int(base.is_gradient_checkpointing)
    installed["attn_implementation"] = base.config._attn_implementation
    return {"installed": installed, "loss": [line["loss"] for line in lines],
            "tokens": [line["tokens"] for line in lines],
            "trained_tokens": [line["trained_tokens"] for line in lines], "lr": [line["lr"] for line in lines],
            "first_grads": {names[i]: g for i, g in first_grads.items()},
            "final": load_file(os.path.join(result.adapter_dir, "adapter_model.safetensors"))}


# ---- comparing --------------------------------------------------------------------------------------------


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def compare(ours: dict, ref: dict) -> dict:
    """The figures the test asserts on (and prints)."""
    rel = [abs(a - b) / abs(b) for a, b in zip(ours["loss"], ref["loss"], strict=True)]
    keys = sorted(ref["final"])
    assert sorted(ours["final"]) == keys, "the saved adapter's tensors are not the reference's"
    per_tensor = {k: cosine(ours["final"][k], ref["final"][k]) for k in keys}
    delta = {k: cosine(ours["final"][k] - ref["initial"][k], ref["final"][k] - ref["initial"][k]) for k in keys}
    flat = cosine(torch.cat([ours["final"][k].flatten() for k in keys]),
                  torch.cat([ref["final"][k].flatten() for k in keys]))
    flat_delta = cosine(torch.cat([(ours["final"][k] - ref["initial"][k]).flatten() for k in keys]),
                        torch.cat([(ref["final"][k] - ref["initial"][k]).flatten() for k in keys]))
    grads = {n: cosine(ours["first_grads"][n], g) for n, g in ref["first_grads"].items() if g.abs().max() > 0}
    return {"max_rel_loss": max(rel), "step1_rel_loss": rel[0], "min_cos": min(per_tensor.values()), "flat_cos": flat,
            "min_delta_cos": min(delta.values()), "flat_delta_cos": flat_delta,
            "min_first_grad_cos": min(grads.values())}


# ---- the test ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: the step's matmuls are small (2 x 64 tokens), and on a busy 2-core CI runner two
    OpenMP threads spin against each other (measured here: 24 s a step with two threads, 3 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def parity_workspace(tmp_path_factory, real_model_dir, one_thread):
    root = tmp_path_factory.mktemp("runner_parity")
    data = write_chat_data(str(root / "train.jsonl"))
    refs: dict = {}

    def reference(stream: str) -> dict:
        if stream not in refs:
            packing, targets = STREAMS[stream]
            refs[stream] = reference_run(real_model_dir, data, packing, targets)
        return refs[stream]

    return root, real_model_dir, data, reference


@pytest.mark.parametrize("case", list(CASES))
def test_runner_trains_what_the_reference_loop_trains(case, parity_workspace, monkeypatch):
    root, model_dir, data, reference = parity_workspace
    over, stream = CASES[case]
    ref = reference(stream)
    tokenizer = None
    if over.get("offload_embeddings"):
        model_dir, tokenizer = untied_copy(model_dir, str(root / "untied")), model_dir
    ours = run_fitune(monkeypatch, model_dir, data, str(root / case), over, tokenizer)

    # the techniques ran: installed by the runner (the tiled ones with TILE_TOKENS), the chunked loss every step
    expected = {"causal_lm_chunked_loss": STEPS if over.get("loss") == "chunked" else 0,
                "enable_lean_lora": int(bool(over.get("lean_lora"))),
                "enable_lean_norm": int(bool(over.get("lean_norm"))),
                "enable_tiled_mlp": int(bool(over.get("tiled_mlp"))),
                "enable_offloaded_checkpointing": int(over.get("grad_checkpointing") == "offload"),
                "enable_selective_checkpointing": int(str(over.get("grad_checkpointing")).startswith("selective")),
                "enable_offloaded_embeddings": int(bool(over.get("offload_embeddings"))),
                "enable_varlen_attention": int(over.get("packing_attention") == "varlen"),
                "gradient_checkpointing": int("grad_checkpointing" in over),
                "attn_implementation": "fitune_varlen" if over.get("packing_attention") == "varlen" else "sdpa"}
    assert {k: ours["installed"].get(k, 0) for k in expected} == expected

    # the same batches: every step's tokens and trained tokens, and the same learning rates
    assert ours["tokens"] == ref["tokens"]
    assert ours["trained_tokens"] == ref["trained_tokens"]
    assert ours["lr"] == pytest.approx(ref["lr"], rel=1e-12, abs=1e-15)
    assert len(ours["loss"]) == STEPS
    # the first step trained something: every adapter B the reference gives a gradient got one here too
    # (A's gradients are zero at step 1 by design: B starts at zero)
    moving = [n for n, g in ref["first_grads"].items() if "lora_B" in n]
    assert moving and set(moving) <= set(ours["first_grads"])
    dead = [n for n in moving if ours["first_grads"][n] is None or not bool(ours["first_grads"][n].abs().max() > 0)]
    assert not dead, f"{case}: zero first-step gradient for {dead[:3]} ({len(dead)} of {len(moving)})"
    figures = compare(ours, ref)
    print(f"\n{case}: max_rel_loss {figures['max_rel_loss']:.3g} (step 1: {figures['step1_rel_loss']:.3g}), "
          + ", ".join(f"{k} {v:.7f}" for k, v in figures.items() if "rel_loss" not in k))
    assert figures["max_rel_loss"] <= LOSS_RTOL, (case, ours["loss"], ref["loss"])
    assert figures["min_first_grad_cos"] >= COSINE_MIN, figures
    assert figures["min_cos"] >= COSINE_MIN, figures
    assert figures["flat_cos"] >= COSINE_MIN, figures
    assert figures["min_delta_cos"] >= COSINE_MIN, figures
    assert figures["flat_delta_cos"] >= COSINE_MIN, figures
    # and training moved: the loss of the last steps is below the first steps' (the same model, data seen again)
    assert sum(ours["loss"][-5:]) < sum(ours["loss"][:5]), ours["loss"]


def test_gpu_parity_bench_smoke_writes_its_records(tmp_path):
    """bench/train_parity.py --smoke: the GPU script's whole flow on the CPU (tiny Llama, bf16, two cases): a noise
    line, then one line per case with its provenance, both loss curves and a passing verdict."""
    from bench.train_parity import SMOKE_CASES, main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "train_parity.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["case"] for r in records] == ["noise", *SMOKE_CASES]
    noise = records[0]
    assert noise["noise_repeat"] == 0.0  # the CPU's kernels are deterministic: the same run twice is bit-equal
    assert 0 < noise["noise_ulp"] < noise["tolerance"]
    for r in records:
        assert {"commit", "diff_sha256", "versions", "wall_s"} <= set(r)
        assert set(r["versions"]) >= {"torch", "transformers", "peft", "bitsandbytes", "liger-kernel", "gpu"}
    for r in records[1:]:
        assert r["verdict"] == "pass", r
        assert len(r["loss_fitune"]) == len(r["loss_reference"]) == r["steps"]
        assert r["max_rel_diff"] <= r["tolerance"]
        assert r["first_grad_norm_fitune"] == pytest.approx(r["first_grad_norm_reference"], rel=1e-2)
        assert r["adapter_cosine"] > COSINE_MIN and r["adapter_cosine_min_tensor"] > COSINE_MIN


def test_runner_applies_the_configured_lora_dropout():
    """`lora.dropout` reaches PEFT (wrap_lora once passed 0.0 whatever the config said). The parity cases above run
    with dropout 0: with dropout the two loops would draw different masks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fitune.runtime.model import prepare_model
    from fitune.setup import TrainSetup

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    model = prepare_model(model, TrainSetup(stack="fitune", lora_dropout=0.1))
    drops = [m.lora_dropout["default"] for m in model.modules() if hasattr(m, "lora_dropout")]
    assert drops and all(isinstance(d, torch.nn.Dropout) and d.p == 0.1 for d in drops), drops
