"""fitune's runner against a plain transformers + PEFT loop on one CUDA GPU, bf16, an 8B-shaped model: every technique
the planner can pick trains what the plain loop trains on the same batches. Run on the GPU machine:

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/train_parity.py --out $OUT --cases plain,loss_chunked,lean_lora   # a subset (see CASES)
    python3 bench/train_parity.py --out /tmp/smoke --smoke      # the whole flow on the CPU, tiny model, seconds

The model: the catalog's llama-3.1-8b config (fitune/specs/data), random weights in bf16 on the GPU, drawn after
`torch.manual_seed(seed)` exactly as fitune's runner draws them (`AutoConfig.for_model` + `from_config` under
`torch.device("cuda")`), so both loops start from the same weights. The task random weights can learn: a copy
task in completion format over a small word vocabulary, `w5 w9 w2 |` -> `w5 w9 w2`, 4 to 120 words per record
(varied lengths: padding and packing matter); only the copied half is trained. The loss first falls from ln(128k)
to the small vocabulary's entropy, then further as the copy is learnt.

Each case runs fitune's user path, `fitune.train.loop.train(cfg)` (a config, the data file, metrics.jsonl), and the
reference loop written here (transformers, PEFT, torch: `get_peft_model(LoraConfig(...))`, the logits, the summed
token cross-entropy / the step's predicted tokens, `clip_grad_norm_`, `torch.optim.AdamW`, the cosine-with-warm-up
rate written out) over the same batches: the reference takes the items (token ids and labels) of the runner's
BatchStream from fitune.data, as tests/test_runner_parity.py does, and pads them itself; a packed row is split back
into its examples, each run as its own padded row (what packing must equal). QLoRA's reference builds its NF4 model
with fitune.runtime.model.build_model (the weights' construction, not the step; the same seed): the random NF4
weights are an input here, like the data.

bf16 noise. Two reference runs that should agree but round differently: `ref_repeat` (the same run again: what
nondeterministic kernels change) and `ref_ulp` (every element of the input embedding table one bf16 ulp further
from zero: a perturbation the size of one bf16 rounding of one tensor, what a technique that rounds one op
differently does). NOISE is the largest per-step relative loss difference of either against the reference. A
technique passes when its largest per-step relative loss difference is at most NOISE_FACTOR x NOISE (and at least
NOISE_FLOOR) and its first step's trainable gradient is non-zero: a different but equally valid rounding grows over
the steps as the perturbation's does; a wrong mask, a lost token, a wrong normalisation or a dead gradient moves the
loss by percents from the first steps on.

One JSON line per case, appended to --out/train_parity.jsonl as soon as the case ends (a run cut at its time limit
keeps the lines before): the case, its config keys, the commit (`git rev-parse HEAD`, or FITUNE_COMMIT where the
copy has no .git) and the sha256 of `git diff HEAD` ("" when clean; FITUNE_DIFF_SHA256), package versions (torch,
transformers, peft, bitsandbytes, liger-kernel), the GPU, both loss trajectories, the first step's trainable-gradient
norm in both (before clipping; fitune's read where the runner checks its first step's gradients), the adapters'
cosine similarity at the end, the largest relative difference, the noise, the tolerance and the verdict
(pass / FAIL / error / skipped). The noise lines come first (case "noise"), one per reference stream; each case is judged by its stream's noise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import code_version, training_facts, write_record  # noqa: E402

MODEL = "llama-3.1-8b"
SMOKE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 128, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
                "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
"""--smoke's model: a tiny Llama whose 128 rows hold the smoke tokenizer's words."""

SEED = 0
WARMUP = 3
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
NOISE_FACTOR = 3.0
NOISE_FLOOR = 1e-3
"""The tolerance never goes below this relative difference (bf16 has 8 bits of mantissa: 4e-3 per rounding)."""

QV = ["q_proj", "v_proj"]
CASES = {
    # name: (config keys over the base config, the reference stream)
    "plain": ({}, "rows"),
    "loss_chunked": ({"loss": "chunked"}, "rows"),
    "lean_lora": ({"lean_lora": True}, "rows"),
    "lean_norm": ({"lean_norm": True}, "rows"),
    "tiled_mlp": ({"tiled_mlp": True}, "rows"),
    "ckpt_full": ({"grad_checkpointing": "full"}, "rows"),
    "ckpt_offload": ({"grad_checkpointing": "offload"}, "rows"),
    "ckpt_selective": ({"grad_checkpointing": "selective:16"}, "rows"),
    "offload_embeddings": ({"offload_embeddings": True}, "rows"),
    "packing_varlen": ({"packing": True, "packing_attention": "varlen"}, "packed"),
    "packing_mask": ({"packing": True, "packing_attention": "mask"}, "packed"),
    "kernels_liger": ({"kernels": "liger"}, "rows"),
    "compile_layers": ({"compile": "layers", "lean_lora": True, "loss": "chunked"}, "rows"),
    "planner_pick": ({"compile": "layers", "lean_lora": True, "loss": "chunked", "grad_checkpointing": "selective:8",
                      "packing": True, "packing_attention": "varlen"}, "packed"),
    "qlora": ({"method": "qlora"}, "qlora_rows"),
    "qlora_chunked_lean_ckpt": ({"method": "qlora", "loss": "chunked", "lean_lora": True,
                                 "grad_checkpointing": "full"}, "qlora_rows"),
}
STREAMS = {"rows": (False, "lora"), "packed": (True, "lora"), "qlora_rows": (False, "qlora")}
"""Reference runs: (packing, method); one each, shared by its cases."""
SMOKE_CASES = ("plain", "loss_chunked")
SMOKE_STEPS = 10


# ---- provenance --------------------------------------------------------------------------------------------


def provenance() -> dict:
    """The code that ran (bench.common.code_version): git's commit and the sha256 of `git diff HEAD` ("" when
    clean); FITUNE_COMMIT / FITUNE_DIFF_SHA256 where the copy has no .git."""
    return code_version()


def versions() -> dict:
    import importlib.metadata

    import torch

    v = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "liger-kernel", "triton"):
        try:
            v[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            v[name] = None
    v["torch"] = torch.__version__
    v["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return v


# ---- data --------------------------------------------------------------------------------------------------


def write_copy_data(path: str, words: list[str], n_records: int, max_words: int, seed: int = 0) -> str:
    """Completion records `w.. w.. |` -> `w.. w..` of 4 to `max_words` words (the copy is what is trained)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_records):
            seq = " ".join(rng.choice(words) for _ in range(rng.randint(4, max_words)))
            f.write(json.dumps({"prompt": f"{seq} |", "completion": seq}) + "\n")
    return path


def stream_steps(tokenizer_dir: str, data_path: str, packing: bool, args) -> tuple[list[list], int]:
    """The items of each step's batch as fitune's runner takes them (fitune/train/loop.py's BatchStream)."""
    from fitune import data as data_mod
    from fitune.runtime.model import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    examples, _ = data_mod.tokenize_records(data_mod.read_records(data_path), tokenizer, "completion", args.seq_len)
    items = data_mod.pack(examples, args.seq_len) if packing else examples
    stream = data_mod.BatchStream(items, args.batch_size, SEED, data_mod.pad_id(tokenizer), packed=packing)
    return [list(stream.next_batch().items) for _ in range(args.steps)], data_mod.pad_id(tokenizer)


def padded_rows(items, pad_id: int, device):
    """One right-padded row per example (a packed row split back into its examples): ids, mask, labels."""
    import torch

    examples = []
    for item in items:
        ids, labels = list(item.input_ids), list(item.labels)
        starts = list(getattr(item, "boundaries", (0,)))
        examples += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:] + [len(ids)])]
    width = max(len(x) for x, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, (x, y) in enumerate(examples):
        ids[r, :len(x)], mask[r, :len(x)], labels[r, :len(y)] = torch.tensor(x), 1, torch.tensor(y)
    return ids.to(device), mask.to(device), labels.to(device)


# ---- the reference loop ------------------------------------------------------------------------------------


def lr_at(step: int, args) -> float:
    """Linear warm-up over WARMUP steps, then half a cosine to 0 at the last step (transformers' cosine schedule)."""
    if step < WARMUP:
        return args.lr * step / max(1, WARMUP)
    progress = (step - WARMUP) / max(1, args.steps - WARMUP)
    return args.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_reference_model(hf_config: dict, method: str, dtype, device: str):
    """The runner's random weights, drawn the same way after the same seed (see the module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    if method == "qlora":
        from fitune.runtime.model import build_model

        return build_model(hf_config, dtype_name="bf16", attn="sdpa", device=device, quantize="nf4", init="random")
    config = AutoConfig.for_model(hf_config["model_type"], **{k: v for k, v in hf_config.items() if k not in (
        "architectures", "torch_dtype", "model_type", "dtype")})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def reference_run(hf_config: dict, stream: str, steps: list, pad_id: int, args, perturb: bool = False) -> dict:
    """The plain loop: per-step loss, first-step gradient norm (before clipping), final adapters."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    packing, method = STREAMS[stream]
    device = args.device
    model = build_reference_model(hf_config, method, torch.bfloat16, device)
    if perturb:  # every element of the embedding table one bf16 ulp further from zero: its bits + 1 (sign-magnitude)
        emb = model.get_input_embeddings().weight
        with torch.no_grad():
            emb.view(torch.int16).add_(1)
    model.config.use_cache = False
    # no seed here: the runner seeds once, before building its model, and LoRA's A is drawn from what the model's
    # construction left of that seed's stream; the same construction here leaves the same state
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=QV, lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=WEIGHT_DECAY)
    losses, grad_norm = [], None
    for step, items in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        ids, mask, labels = padded_rows(items, pad_id, device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        predicted = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 predicted.reshape(-1), ignore_index=-100, reduction="sum")
        loss = loss / int((predicted != -100).sum())
        del logits
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        if step == 0:
            grad_norm = float(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    adapters = {k: v.detach().float().cpu() for k, v in get_peft_model_state_dict(model).items()}
    del model, optimizer, params
    free(device)
    return {"loss": losses, "first_grad_norm": grad_norm, "adapters": adapters}


# ---- fitune's runner ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tiles(tile_tokens: int):
    """The tiled techniques with tiles of `tile_tokens` (fitune's defaults would hold a short step in one tile), and
    the runner's first-step gradient check wrapped to record the trainable gradients' norm (before clipping)."""
    from unittest import mock

    import torch

    from fitune.runtime import step as step_mod
    from fitune.runtime.techniques import chunked_loss, lean_norm, tiled_mlp

    seen: dict = {}
    real_check = step_mod.require_gradients

    def require_gradients(model):
        grads = [p.grad.float() for p in model.parameters() if p.requires_grad and p.grad is not None]
        seen["first_grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) \
            if grads else 0.0
        return real_check(model)

    with mock.patch.object(tiled_mlp, "enable_tiled_mlp",
                           functools.partial(tiled_mlp.enable_tiled_mlp, tile_tokens=tile_tokens)), \
            mock.patch.object(lean_norm, "enable_lean_norm",
                              functools.partial(lean_norm.enable_lean_norm, tile_tokens=tile_tokens)), \
            mock.patch.object(chunked_loss, "causal_lm_chunked_loss",
                              functools.partial(chunked_loss.causal_lm_chunked_loss, chunk_tokens=tile_tokens)), \
            mock.patch.object(step_mod, "require_gradients", require_gradients):
        yield seen


def fitune_run(model: str, tokenizer_dir: str, data_path: str, out_dir: str, over: dict, args) -> dict:
    from safetensors.torch import load_file

    from fitune.config import config_from_dict
    from fitune.train.loop import train

    doc = {"model": model, "init": "random", "tokenizer": tokenizer_dir,
           "data": {"path": data_path, "format": "completion"}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": QV}, "dtype": "bf16", "attn": "sdpa",
           "seq_len": args.seq_len, "batch_size": args.batch_size, "grad_accum": 1, "max_steps": args.steps,
           "lr": args.lr, "weight_decay": WEIGHT_DECAY, "schedule": "cosine", "warmup_steps": WARMUP,
           "max_grad_norm": MAX_GRAD_NORM, "seed": SEED, "stack": "fitune", "output_dir": out_dir,
           "save_every_minutes": None, "oom_guard": False}
    doc.update(over)
    with small_tiles(args.tile_tokens) as seen:
        result = train(config_from_dict(doc, "bench"), progress=False)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    adapters = {k: v.float() for k, v in load_file(os.path.join(result.adapter_dir,
                                                                "adapter_model.safetensors")).items()}
    del result
    free(args.device)
    return {"loss": [line["loss"] for line in lines if "loss" in line], "first_grad_norm": seen.get("first_grad_norm"),
            "adapters": adapters}


# ---- comparing ---------------------------------------------------------------------------------------------


def rel_diffs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)]


def cosine(x, y) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-300))


def adapter_cosine(a: dict, b: dict) -> tuple[float | None, float | None]:
    """(over all adapter tensors flattened, the smallest per tensor); None when the tensors differ by name."""
    import torch

    if sorted(a) != sorted(b):
        return None, None
    keys = sorted(a)
    flat = cosine(torch.cat([a[k].flatten() for k in keys]), torch.cat([b[k].flatten() for k in keys]))
    return flat, min(cosine(a[k], b[k]) for k in keys)


def free(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def append(path: str, record: dict, training: dict) -> None:
    write_record(path, record, training=training)
    print(json.dumps({k: record.get(k) for k in ("case", "verdict", "max_rel_diff", "tolerance", "wall_s")}),
          flush=True)


# ---- main --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder; the records are appended to OUT/train_parity.jsonl")
    p.add_argument("--cases", default="all", help=f"comma-separated, or all: {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--tile-tokens", type=int, default=256, help="tiles / chunks of the tiled techniques")
    p.add_argument("--words", type=int, default=64, help="the copy task's vocabulary")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny Llama, two cases (plain, loss_chunked)")
    p.add_argument("--print-provenance", action="store_true",
                   help="print FITUNE_COMMIT=... FITUNE_DIFF_SHA256=... for a command run where .git is absent")
    args = p.parse_args(argv)
    if args.print_provenance:
        prov = provenance()
        print(f"FITUNE_COMMIT={prov['commit']} FITUNE_DIFF_SHA256={prov['diff_sha256']}")
        return 0
    if not args.out:
        p.error("--out is required")

    import torch

    if args.smoke:
        args.device, args.seq_len, args.words, args.tile_tokens = "cpu", 64, 16, 16
        args.steps = min(args.steps, SMOKE_STEPS)
        names = list(SMOKE_CASES) if args.cases == "all" else args.cases.split(",")
        hf_config = dict(SMOKE_CONFIG)
    else:
        if not torch.cuda.is_available():
            print("train_parity: no CUDA GPU here; run it on the GPU machine, or use --smoke", file=sys.stderr)
            return 2
        from fitune.specs.model import load_model_spec

        args.device = "cuda"
        names = list(CASES) if args.cases == "all" else args.cases.split(",")
        hf_config = dict(load_model_spec(MODEL).hf_config)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"train_parity: unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "train_parity.jsonl")
    work = tempfile.mkdtemp(prefix="train_parity_")
    try:
        from fitune.train.synthetic import make_word_tokenizer, synthetic_words

        words = synthetic_words(args.words)
        tokenizer_dir = make_word_tokenizer(os.path.join(work, "tokenizer"), words + ["|"])
        max_words = max(4, min(120, (args.seq_len - 4) // 2))
        data = write_copy_data(os.path.join(work, "train.jsonl"), words, n_records=8 * args.steps,
                               max_words=max_words)
        model = os.path.join(work, "config.json")  # fitune's `model:` with init random: a config.json
        with open(model, "w") as f:
            json.dump(hf_config, f)
        common = {**provenance(), "versions": versions(), "model": "smoke" if args.smoke else MODEL,
                  "steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
                  "tile_tokens": args.tile_tokens, "dtype": "bf16", "lora": "r8 alpha16 q_proj,v_proj",
                  "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]))}

        # every reference first: nothing a technique installs can reach them
        refs, streams = {}, {}
        for stream in dict.fromkeys(CASES[n][1] for n in names):
            if STREAMS[stream][1] == "qlora" and args.device != "cuda":
                continue
            streams[stream] = stream_steps(tokenizer_dir, data, STREAMS[stream][0], args)
            t0 = time.perf_counter()
            refs[stream] = reference_run(hf_config, stream, *streams[stream], args)
            refs[stream]["wall_s"] = time.perf_counter() - t0
        # the noise of each stream: its reference again, and with the 1-ulp perturbation (each case is judged by
        # its own stream's noise: packed rows and padded rows round differently)
        noises = {}
        for stream in refs:
            t0 = time.perf_counter()
            repeat = reference_run(hf_config, stream, *streams[stream], args)
            ulp = reference_run(hf_config, stream, *streams[stream], args, perturb=True)
            noise_repeat = max(rel_diffs(repeat["loss"], refs[stream]["loss"]))
            noise_ulp = max(rel_diffs(ulp["loss"], refs[stream]["loss"]))
            noise = max(noise_repeat, noise_ulp)
            noises[stream] = (noise, max(NOISE_FACTOR * noise, NOISE_FLOOR))
            append(out_path, {**common, "case": "noise", "stream": stream, "loss_reference": refs[stream]["loss"],
                              "loss_repeat": repeat["loss"], "loss_ulp": ulp["loss"], "noise_repeat": noise_repeat,
                              "noise_ulp": noise_ulp, "noise": noise, "tolerance": noises[stream][1],
                              "first_grad_norm_reference": refs[stream]["first_grad_norm"],
                              "verdict": "measured", "wall_s": time.perf_counter() - t0},
                   training_facts(refs[stream]["loss"], {"first_step_grad_norm": refs[stream]["first_grad_norm"]}))
            del repeat, ulp

        for name in names:
            over, stream = CASES[name]
            noise, tolerance = noises.get(stream, (None, None))
            rec = {**common, "case": name, "config": over, "stream": stream, "noise": noise, "tolerance": tolerance}
            t0 = time.perf_counter()
            if stream not in refs:
                rec.update(verdict="skipped", why=f"the {stream} reference needs a CUDA GPU (bitsandbytes NF4)")
                append(out_path, rec, training_facts([], None, why_none=rec["why"]))
                continue
            ref = refs[stream]
            try:
                ours = fitune_run(model, tokenizer_dir, data, os.path.join(work, name), over, args)
            except Exception as exc:  # noqa: BLE001 - one case's failure is a result; the others still run
                rec.update(verdict="error", error=f"{type(exc).__name__}: {exc}"[:2000],
                           traceback=traceback.format_exc()[-3000:], wall_s=time.perf_counter() - t0)
                append(out_path, rec, training_facts([], None, why_none=rec["error"][:300]))
                free(args.device)
                continue
            finally:
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
                if over.get("compile") == "layers":
                    torch._dynamo.reset()
            diffs = rel_diffs(ours["loss"], ref["loss"])
            flat_cos, min_cos = adapter_cosine(ours["adapters"], ref["adapters"])
            same_start = diffs[0] <= tolerance  # step 1 depends on the base weights only (B starts at zero)
            rec.update(loss_fitune=ours["loss"], loss_reference=ref["loss"], rel_diff=diffs, max_rel_diff=max(diffs),
                       mean_rel_diff=sum(diffs) / len(diffs), same_start=same_start,
                       first_grad_norm_fitune=ours["first_grad_norm"],
                       first_grad_norm_reference=ref["first_grad_norm"],
                       adapter_cosine=flat_cos, adapter_cosine_min_tensor=min_cos,
                       loss_fell=sum(ours["loss"][-5:]) < sum(ours["loss"][:5]),
                       wall_s=time.perf_counter() - t0)
            grads_ok = bool(ours["first_grad_norm"]) and ours["first_grad_norm"] > 0
            rec["verdict"] = "pass" if max(diffs) <= tolerance and grads_ok else "FAIL"
            append(out_path, rec, training_facts(ours["loss"], {"first_step_grad_norm": ours["first_grad_norm"]}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
