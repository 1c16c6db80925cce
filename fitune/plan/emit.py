"""A plan in the two forms users run: a `fitune train` config (YAML) and the equivalent Hugging Face code.

The YAML is `TrainConfig.to_dict()` of the plan (so its keys are the runner's own), written without PyYAML;
tests/test_plan.py reads it back with PyYAML and passes it to `fitune.config.config_from_dict`.
The Hugging Face code mirrors what the plan was estimated as (fitune's runner = the HF recipe of
bench/hf_recipe.py): bf16 weights (or NF4 with double quantisation for QLoRA), LoRA dropout 0, non-reentrant
checkpointing, `use_cache=False`, no `prepare_model_for_kbit_training` (it upcasts the non-quantised weights to
fp32, which the estimate does not include).
"""

from __future__ import annotations

import json
import os
import re

from ..config import DataConfig, TrainConfig
from ..setup import TrainSetup
from ..specs import optimizers as optimizer_specs
from ..units import GiB
from .search import Plan, PlanRequest, describe

#: Learning rates written into a plan: common starting points, not tuned (LoRA: the QLoRA paper's 2e-4 for 7B
#: models; full fine-tuning: 1e-5). The user's to change.
LORA_LR = 2.0e-4
FULL_LR = 1.0e-5
#: When --data is not given: the path the written config points at (it must exist before `fitune train`).
PLACEHOLDER_DATA = "train.jsonl"

#: fitune optimizer names -> transformers' TrainingArguments(optim=...) names.
HF_OPTIM = {s.name: s.hf_optim for s in optimizer_specs.REGISTRY}
HF_ATTN = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}

_YAML_ORDER = ("model", "init", "tokenizer", "data", "method", "lora", "freeze_trainable_layers", "dtype", "seq_len",
               "batch_size", "grad_accum", "grad_checkpointing", "attn", "optimizer", "loss", "stack", "packing",
               "epochs", "max_steps", "lr")


def model_location(model_arg: str) -> tuple[str, bool]:
    """(what `model:` should say, whether it is a folder the runner can load pretrained weights from)."""
    from ..specs.sources import is_gguf_path, is_hub_id

    if os.path.isdir(model_arg) or is_hub_id(model_arg) or os.path.isfile(model_arg) and is_gguf_path(model_arg):
        return model_arg, True  # train loads a .gguf file, and a Hub id from the Hub cache (or downloads it)
    if os.path.isfile(model_arg):  # a config.json: its folder holds the weights, if anywhere
        folder = os.path.dirname(model_arg) or "."
        return folder, True
    return model_arg, False


def train_config(plan: Plan, req: PlanRequest, model_arg: str, data_path: str | None = None,
                 tokenizer: str | None = None) -> dict:
    """The `fitune train` config of `plan` as a mapping (TrainConfig.to_dict(), keys in reading order).

    The setup is the plan's, per GPU: `gpus:` and `strategy:` say how many GPUs and how they share the model
    (batch_size x grad_accum x gpus is the effective batch).
    """
    s = plan.setup
    model, _ = model_location(model_arg)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(os.path.normpath(model))) or "model"
    cfg = TrainConfig(model=model, setup=s, data=DataConfig(path=data_path or PLACEHOLDER_DATA),
                      output_dir=f"runs/{name}-{s.method}", tokenizer=tokenizer, epochs=1,
                      lr=LORA_LR if s.method in ("lora", "qlora") else FULL_LR, packing=plan.packing)
    doc = cfg.to_dict()
    return {k: doc[k] for k in sorted(doc, key=lambda k: (_YAML_ORDER.index(k) if k in _YAML_ORDER else 99))}


def to_yaml(doc: dict, comments: list[str] = ()) -> str:
    """Block YAML for a flat mapping whose values are scalars, lists of scalars or one-level mappings."""
    # A comment is one line: a newline in what the user typed (a path) must not start a YAML key.
    lines = [f"# {one_line(str(c))}" if c else "#" for c in comments]
    for key, value in doc.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_yaml_value(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {_yaml_value(value)}")
    return "\n".join(lines) + "\n"


def _yaml_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        text = repr(v)
        if "e" in text and "." not in text.split("e")[0]:  # PyYAML (YAML 1.1) reads 1e-05 as a string
            mantissa, exp = text.split("e")
            text = f"{mantissa}.0e{exp}"
        return text
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    text = str(v)
    plain = re.fullmatch(r"[A-Za-z_./][A-Za-z0-9_./-]*", text) and text.lower() not in (
        "true", "false", "yes", "no", "on", "off", "null", "~")
    return text if plain else yaml_quoted(text)


def yaml_quoted(text: str) -> str:
    """`text` as a YAML double-quoted scalar in plain ASCII: every character outside printable ASCII escaped
    (\\xXX, \\uXXXX, \\UXXXXXXXX), so that any path - newlines, quotes, `: `, `#`, emoji, bytes a file name may
    hold - reads back as itself and cannot end the value."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= o < 0x7F:
            out.append(ch)
        elif o <= 0xFF:
            out.append(f"\\x{o:02x}")
        elif o <= 0xFFFF:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


def one_line(text: str) -> str:
    """`text` for a comment (YAML or Python): one line, every non-printable character (newlines, NUL, a lone
    surrogate from an undecodable file name) written as its escape, so that nothing after it becomes code."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def py_literal(text: str) -> str:
    """`text` as a Python string literal: JSON's double-quoted form while it is ASCII (JSON's escapes mean the same in
    Python), `repr` otherwise (JSON spells characters beyond U+FFFF as surrogate pairs, which Python does not join)."""
    return json.dumps(text) if text.isascii() else repr(text)


def plan_yaml(plan: Plan, req: PlanRequest, model_arg: str, command: str, data_path: str | None = None,
              tokenizer: str | None = None) -> str:
    """The config file `--write` saves: the plan's header comments and the runner's keys."""
    doc = train_config(plan, req, model_arg, data_path, tokenizer)
    _, is_folder = model_location(model_arg)
    comments = [
        f"written by: {command}",
        f"plan: {describe(plan.setup)}" + (", packing" if plan.packing else ""),
        f"estimate: {plan.peak_allocated_bytes / GiB:.2f} GiB allocated, {plan.peak_reserved_bytes / GiB:.2f} GiB "
        f"reserved of {plan.budget_bytes / GiB:.2f} GiB on {req.gpu.name}; predicted {plan.trained_tokens_per_s:,.0f} "
        "tokens/s",
    ]
    if plan.setup.num_gpus > 1 or plan.setup.strategy != "ddp":
        comments.append(f"gpus: {plan.setup.num_gpus}, strategy: {plan.setup.strategy}: batch_size and grad_accum are per "
                        "GPU; unvalidated (the multi-GPU numbers are modelled, not measured)")
    if not is_folder:
        comments.append(f"model: {model_arg} is a catalog name; fitune train loads pretrained weights from a folder: "
                        "download the model and set `model:` to it (or add `init: random` and `tokenizer:` for a "
                        "smoke run)")
    if not data_path:
        comments.append(f"data.path: {PLACEHOLDER_DATA} must exist (JSONL of chat, prompt/completion or text records)")
    comments.append("lr and epochs are starting points, not tuned")
    return to_yaml(doc, comments)


def hf_code(plan: Plan, req: PlanRequest, model_arg: str, hf_id: str | None = None, data_path: str | None = None) -> str:
    """Python that trains the plan with transformers' Trainer + PEFT (the user's own script, same memory)."""
    s: TrainSetup = plan.setup
    model_ref = hf_id or model_location(model_arg)[0]
    techniques = _fitune_techniques(s)
    body = _hf_header(plan, req)
    body += _hf_imports(s, techniques)
    body.append("")
    body += _hf_load_model(s, model_ref)
    body.append("model.config.use_cache = False  # no KV cache in training")
    body += _hf_adapt_model(s)
    body += [line for _, _, lines in techniques for line in lines]
    if s.loss == "chunked":
        body += _CHUNKED_LOSS_TRAINER
    body += _hf_trainer(plan, model_ref, data_path)
    # Comments quote what the user typed (the GPU, the data path): each stays one line, whatever it holds.
    return "\n".join(one_line(line) if line.lstrip().startswith("#") else line for line in body)


def _hf_header(plan: Plan, req: PlanRequest) -> list[str]:
    """The script's first comments: the setup, its estimate and predicted speed, how to launch it, what it needs."""
    s = plan.setup
    body = [f"# fitune plan: {describe(s)}" + (", packing" if plan.packing else ""),
            f"# estimate: {plan.peak_allocated_bytes / GiB:.2f} GiB allocated, {plan.peak_reserved_bytes / GiB:.2f} GiB "
            f"reserved of {plan.budget_bytes / GiB:.2f} GiB ({req.gpu.name}); predicted "
            f"{plan.trained_tokens_per_s:,.0f} tokens/s"]
    if plan.num_gpus > 1 and s.strategy == "ddp":
        body.append(f"# data parallel: torchrun --nproc_per_node {plan.num_gpus} this_script.py "
                    "(each GPU holds a full copy)")
    elif s.strategy != "ddp":
        body.append(f"# {s.strategy} on {plan.num_gpus} GPU(s): the estimate assumes "
                    + ("FSDP2 (fully_shard per decoder layer)" if s.strategy == "fsdp" else
                       f"DeepSpeed ZeRO-{3 if s.strategy.startswith('zero3') else 2} with its default buckets"
                       + (" and offload_param / offload_optimizer to the CPU" if s.strategy == "zero3_offload" else ""))
                    + "; set it up in TrainingArguments (fsdp= or deepspeed=) and launch with torchrun / accelerate")
    if plan.requires:
        body.append(f"# needs: {', '.join(plan.requires)}")
    return body


def _hf_imports(s: TrainSetup, techniques: list[tuple[str, str, list[str]]]) -> list[str]:
    """The allocator setting (before torch starts), then the imports: transformers, PEFT, fitune's techniques."""
    imports = ["from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments"]
    if s.method == "qlora":
        imports[0] = ("from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, Trainer, "
                      "TrainingArguments")
    if s.method in ("lora", "qlora"):
        imports.append("from peft import LoraConfig, get_peft_model")
    body = []
    if s.expandable_segments:
        body += ["import os", "",
                 'os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch uses the GPU']
    body += ["import torch", *imports]
    if techniques:
        body += ["# fitune's techniques that this plan's memory estimate counts on (pip install fitune; each is exact)"]
        body += [f"from fitune.runtime.techniques.{module} import {name}" for module, name, _ in techniques]
    return body


def _hf_load_model(s: TrainSetup, model_ref: str) -> list[str]:
    """`AutoModelForCausalLM.from_pretrained(...)` in the plan's dtype and attention (4-bit NF4 for QLoRA)."""
    dtype = "torch.bfloat16" if s.dtype == "bf16" or s.method == "qlora" else (
        "torch.float16" if s.dtype == "fp16" else "torch.float32")
    load = ["model = AutoModelForCausalLM.from_pretrained(",
            f"    {py_literal(model_ref)},",
            f"    dtype={dtype},",
            f"    attn_implementation={json.dumps(HF_ATTN[s.attn])},"]
    if s.method == "qlora":
        load += ["    quantization_config=BitsAndBytesConfig(",
                 '        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,',
                 "        bnb_4bit_compute_dtype=torch.bfloat16,",
                 "    ),",
                 '    device_map={"": 0},']
    load.append(")")
    return load


def _hf_adapt_model(s: TrainSetup) -> list[str]:
    """Liger's kernels, then what trains: PEFT's LoRA, or the last layers (freeze)."""
    body = []
    if s.kernels == "liger":
        body.append("enable_liger_kernels(model)  # Liger's fused RMSNorm, SwiGLU and RoPE, before LoRA wraps the model")
    if s.method in ("lora", "qlora"):
        targets = py_literal("all-linear") if s.all_linear else "[" + ", ".join(map(py_literal, s.lora_targets)) + "]"
        body += ["model = get_peft_model(model, LoraConfig(",
                 f"    r={s.lora_rank}, lora_alpha={s.lora_alpha}, target_modules={targets}, "
                 f"lora_dropout={float(s.lora_dropout)!r},",
                 '    task_type="CAUSAL_LM",',
                 "))"]
    elif s.method == "freeze":
        body += ["for p in model.parameters():",
                 "    p.requires_grad_(False)",
                 f"for layer in model.model.layers[-{s.freeze_trainable_layers}:]:  # the last layers train",
                 "    for p in layer.parameters():",
                 "        p.requires_grad_(True)"]
    return body


#: The Trainer subclass a plan with fitune's chunked loss writes (its import comes with the techniques).
_CHUNKED_LOSS_TRAINER = [
    "",
    "",
    "class ChunkedLossTrainer(Trainer):",
    '    """Trainer whose loss never materialises the whole sequence\'s logits (fitune\'s chunked loss)."""',
    "",
    "    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):",
    "        inputs = dict(inputs)",
    '        loss = causal_lm_chunked_loss(model, inputs.pop("input_ids"), inputs.pop("labels"),',
    "                                      num_items=num_items_in_batch, use_cache=False, **inputs)",
    "        return (loss, None) if return_outputs else loss",
    "",
]


def _hf_trainer(plan: Plan, model_ref: str, data_path: str | None) -> list[str]:
    """The tokenizer, the data set placeholder, TrainingArguments and the Trainer, then `trainer.train()`."""
    s = plan.setup
    body = ["",
            f"tokenizer = AutoTokenizer.from_pretrained({py_literal(model_ref)})",
            f"# train_dataset: tokenized examples (input_ids, labels) of at most {s.seq_len_tokens} tokens"
            + (f", from {py_literal(data_path)}" if data_path else "")
            + ("; packed into rows of that length (e.g. TRL SFTConfig(packing=True))" if plan.packing else ""),
            "train_dataset = ...",
            "",
            "args = TrainingArguments(",
            f"    output_dir={json.dumps('runs/' + s.method)},",
            f"    per_device_train_batch_size={s.batch_size},",
            f"    gradient_accumulation_steps={s.grad_accum},"]
    if s.checkpointed_layers_mode == "full":  # offload and selective: set up above (the Trainer would turn it on
        # on every layer)
        body += ["    gradient_checkpointing=True,",
                 '    gradient_checkpointing_kwargs={"use_reentrant": False},']
    if s.dtype == "bf16" or s.method == "qlora":
        body.append("    bf16=True,")
    elif s.dtype == "fp16":
        body.append("    fp16=True,")
    body += [f"    optim={json.dumps(HF_OPTIM[s.optimizer])},",
             f"    learning_rate={LORA_LR if s.method in ('lora', 'qlora') else FULL_LR!r},",
             "    num_train_epochs=1,",
             "    logging_steps=1,",
             ")",
             f"trainer = {'ChunkedLossTrainer' if s.loss == 'chunked' else 'Trainer'}(model=model, args=args, "
             "train_dataset=train_dataset)"]
    if s.offload_embeddings:
        body.append("enable_offloaded_embeddings(trainer.model)  # after the Trainer put the model on the GPU: the "
                    "input embedding table moves to CPU memory")
    body += ["trainer.train()",
             ""]
    return body


def _fitune_techniques(s: TrainSetup) -> list[tuple[str, str, list[str]]]:
    """(module, function, lines that apply it after LoRA wraps the model) for each fitune technique of `s`."""
    out = []
    if s.kernels == "liger":  # applied right after loading (see hf_code)
        out.append(("fused_kernels", "enable_liger_kernels", []))
    if s.lean_lora:
        out.append(("lean_lora", "enable_lean_lora", ["enable_lean_lora(model)  # LoRA branch in bf16: no fp32 copy of "
                                                     "each adapter's input"]))
    if s.lean_norm:
        out.append(("lean_norm", "enable_lean_norm", ["enable_lean_norm(model)  # RMSNorm in tiles, saving only its "
                                                     "bf16 input"]))
    if s.tiled_mlp:
        out.append(("tiled_mlp", "enable_tiled_mlp", ["enable_tiled_mlp(model)  # the MLP a tile of tokens at a time"]))
    if s.checkpointed_layers_mode == "offload":
        out.append(("offload", "enable_offloaded_checkpointing", [
            'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})',
            "enable_offloaded_checkpointing(model)  # each layer's input waits in pinned host memory"]))
    if s.checkpointed_layers_mode == "selective":
        out.append(("offload", "enable_selective_checkpointing", [
            'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})',
            f"enable_selective_checkpointing(model, {s.selective_k()})  # checkpointing on the first "
            f"{s.selective_k()} layers only: the others keep their activations"]))
    if s.offload_embeddings:  # applied once the Trainer has placed the model (see hf_code)
        out.append(("offload_embeddings", "enable_offloaded_embeddings", []))
    if s.compile == "layers":  # last: the compiled layers trace the techniques above
        out.append(("compile_layers", "enable_compiled_layers", [
            "enable_compiled_layers(model)  # torch.compile each decoder layer (keep torch_compile=False: not the "
            "whole model)"]))
    if s.loss == "chunked":
        out.append(("chunked_loss", "causal_lm_chunked_loss", []))
    return out
