"""Rules about how text becomes a batch: padding, truncation, labels, packing."""

from __future__ import annotations

import ast
from typing import Iterator

from ...errors import FituneError
from ...specs.model import model_catalog, resolve_model_source
from .. import evidence
from ..evidence import catalog_name
from ..findings import ERROR, INFO, WARNING
from ..index import ScriptIndex, tokenizer_calls
from .base import Hit, call_text, known_setup, rule, script_catalog_model, script_model

SMALL_MAX_LENGTH = 256
"""Padding to a fixed length at or below this many tokens is left alone (cheap, sometimes needed for static shapes)."""
NOT_TRAINING_FUNCTIONS = ("generate", "infer", "predict", "demo")
"""Tokeniser calls inside functions whose name contains one of these are prompts for generation, not training data."""
CONCAT_CALLS = ("cat", "concat", "concatenate", "hstack")


@rule("pad-to-max-length", WARNING, 'padding="max_length" with a large max_length', ("C20", "C21"))
def pad_to_max_length(ix: ScriptIndex) -> Iterator[Hit]:
    sites = tokenizer_calls(ix) + [c for c in ix.calls if c.tail.startswith("DataCollator")]
    for c in sites:
        if ix.value(c.kw("padding")) != "max_length" and not ix.is_true(c.kw("pad_to_max_length")):
            continue
        max_length = ix.value(c.kw("max_length"))
        if isinstance(max_length, int) and max_length <= SMALL_MAX_LENGTH:
            continue
        if c.kw("max_length") is None:
            length = "the tokenizer's model_max_length (no max_length given; 131072 for Llama 3.1)"
        elif isinstance(max_length, int):
            length = f"max_length={max_length}"
        else:
            length = "max_length (not a constant in this script)"
        yield Hit(
            c.line,
            f"`{call_text(c)}` pads every example to {length}: padding tokens go through every layer and "
            "cost the same activation memory and time as real ones.",
            "padding=False here and a collator that pads each batch to its longest example "
            "(DataCollatorWithPadding / DataCollatorForSeq2Seq, pad_to_multiple_of=8), or packing; "
            "`fitune doctor --data FILE --tokenizer DIR` shows how much padding your data would carry",
            evidence.seq_len_cost(script_model(ix), known_setup(ix)),
        )


@rule("tokenize-without-truncation", WARNING, "tokenizer call without truncation=True", ("C21",))
def tokenize_without_truncation(ix: ScriptIndex) -> Iterator[Hit]:
    for c in tokenizer_calls(ix):
        if c.grad_disabled or c.open_kwargs or any(w in c.function.lower() for w in NOT_TRAINING_FUNCTIONS):
            continue
        truncation = c.kw("truncation")
        if truncation is not None and not ix.is_false(truncation) and ix.value(truncation) is not None:
            continue
        yield Hit(
            c.line,
            f"`{call_text(c)}` does not truncate: one long example makes a batch as long as itself, and the "
            "step that meets it runs out of memory (often hours into the run).",
            "truncation=True, max_length=<your sequence length>; count what would be cut with "
            "`fitune doctor --data FILE --tokenizer DIR --seq-len N`",
            evidence.long_example_cost(known_setup(ix)),
        )


@rule("labels-concatenate-inputs", WARNING, "labels built by concatenating input_ids", ("C09",))
def labels_concatenate_inputs(ix: ScriptIndex) -> Iterator[Hit]:
    values = [(a.line, a.value) for a in ix.assignments if a.target in ("labels", '["labels"]')]
    values += [(c.line, c.kw("labels")) for c in ix.calls if c.kw("labels") is not None]
    for line, value in values:
        if not _concatenates_inputs(ix, value):
            continue
        yield Hit(
            line,
            "labels are built by concatenating input_ids with more tokens: a causal LM's labels are the input_ids "
            "themselves (transformers shifts them by one inside the loss), so the labels no longer line up with the "
            "input, or the input was doubled to match and every step pays for twice the sequence.",
            "labels = input_ids.clone() (or a copy of the list), with the prompt positions set to -100",
            evidence.doubled_sequence(script_model(ix), known_setup(ix)),
        )


@rule("sft-without-packing", INFO, "TRL SFTConfig without packing", ("C20",))
def sft_without_packing(ix: ScriptIndex) -> Iterator[Hit]:
    configs = ix.calls_named("SFTConfig") or ix.calls_named("SFTTrainer")
    sites = ix.calls_named("SFTConfig") + ix.calls_named("SFTTrainer")
    if not configs or any(c.open_kwargs for c in configs):
        return
    if any(ix.is_true(c.kw("packing")) or ix.is_true(c.kw("padding_free")) for c in sites):
        return
    c = configs[0]
    yield Hit(
        c.line,
        f"`{call_text(c)}` trains without packing: each batch is padded to its longest example. On short "
        "examples most of a batch can be padding; packing fills each row with several examples instead.",
        "packing=True in SFTConfig (TRL keeps the examples apart with position_ids when padding_free / flash "
        "attention is on); first measure: `fitune doctor --data FILE --tokenizer DIR` prints the padding share "
        "of dynamic padding vs packing",
        "reasoned (not measured): at a fixed max_length packing does not change the per-step peak, it replaces "
        "padding tokens with real ones; the share of padding depends on your data (fitune doctor --data)",
    )


def _mentions_input_ids(node: ast.AST) -> bool:
    """`input_ids`, `x.input_ids`, `batch["input_ids"]`, but not a slice of them (a shift is legitimate)."""
    if isinstance(node, ast.Subscript):  # batch["input_ids"] yes; input_ids[:, 1:] no
        return isinstance(node.slice, ast.Constant) and node.slice.value == "input_ids"
    if isinstance(node, ast.Name):
        return "input_ids" in node.id
    if isinstance(node, ast.Attribute):
        return node.attr == "input_ids"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("clone", "copy"):
        return _mentions_input_ids(node.func.value)
    return False


def _concatenates_inputs(ix: ScriptIndex, value: ast.AST | None) -> bool:
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        operands = _flatten_add(value)
        return len(operands) > 1 and any(_mentions_input_ids(o) for o in operands)
    if isinstance(value, ast.Call) and ix.dotted(value.func).rsplit(".", 1)[-1] in CONCAT_CALLS and value.args:
        seq = value.args[0]
        if isinstance(seq, (ast.List, ast.Tuple)) and len(seq.elts) > 1:
            return any(_mentions_input_ids(e) for e in seq.elts)
    return False


def _flatten_add(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _flatten_add(node.left) + _flatten_add(node.right)
    return [node]


NO_PAD_TOKEN_FAMILIES = ("llama", "mistral", "mixtral")
"""Model types whose published tokenizers set no pad token (tokenizer_config.json of meta-llama/Llama-2-7b-hf,
meta-llama/Llama-3.1-8B, mistralai/Mistral-7B-v0.1 and -v0.3: pad_token null or absent); Qwen's set one."""
PADDING_COLLATORS = ("DataCollatorWithPadding", "DataCollatorForSeq2Seq", "DataCollatorForLanguageModeling",
                     "DataCollatorForTokenClassification")


@rule("missing-pad-token", ERROR, "padding with a Llama/Mistral tokenizer that has no pad token")
def missing_pad_token(ix: ScriptIndex) -> Iterator[Hit]:
    """A Llama- or Mistral-family tokenizer pads (padding=True / "max_length", a padding collator, tokenizer.pad)
    but the script never gives it a pad token: transformers raises before the first step."""
    if ix.calls_named("SFTTrainer") or any(c.receiver.endswith("FastLanguageModel") for c in ix.calls):
        return  # TRL's SFTTrainer and Unsloth set pad_token themselves when it is missing
    if _sets_pad_token(ix):
        return
    family = _tokenizer_family(ix)
    if family not in NO_PAD_TOKEN_FAMILIES:
        return
    sites = [c for c in tokenizer_calls(ix) if ix.value(c.kw("padding")) in (True, "max_length", "longest")]
    sites += [c for c in ix.calls if c.tail in PADDING_COLLATORS]
    sites += [c for c in ix.calls if c.tail == "pad" and c.receiver in ix.tokenizer_names]
    if not sites:
        return
    c = min(sites, key=lambda c: c.line)
    yield Hit(
        c.line,
        f"`{call_text(c)}` pads, but the script loads a {family} tokenizer and never sets a pad token ({family} "
        "tokenizers ship without one): transformers raises `ValueError: Asking to pad but the tokenizer does not have "
        "a padding token` at the first padded batch.",
        "tokenizer.pad_token = tokenizer.eos_token right after loading it (with DataCollatorForLanguageModeling "
        "this also masks the real end-of-sequence tokens from the loss; a dedicated pad token avoids that: "
        'tokenizer.add_special_tokens({"pad_token": "<pad>"}) and model.resize_token_embeddings(len(tokenizer)))',
        "source: transformers/tokenization_utils_base.py raises 'Asking to pad but the tokenizer does not have a "
        "padding token' when padding is asked and pad_token is None; the tokenizer_config.json of "
        "meta-llama/Llama-3.1-8B and mistralai/Mistral-7B-v0.3 set no pad_token (reasoned (not measured) from the "
        "published files)",
    )


def _sets_pad_token(ix: ScriptIndex) -> bool:
    if any(a.target.endswith((".pad_token", ".pad_token_id")) for a in ix.assignments):
        return True
    for c in ix.calls:
        if c.tail == "add_special_tokens":
            v = ix.value(c.arg(0) if c.arg(0) is not None else c.kw("special_tokens_dict"))
            if not isinstance(v, dict) or "pad_token" in v:
                return True  # a dict fitune cannot read counts as setting it
        if c.tail == "from_pretrained" and c.has_kw("pad_token"):
            return True
        if c.tail == "setattr" and len(c.node.args) > 1 and ix.value(c.node.args[1]) in ("pad_token", "pad_token_id"):
            return True
    return False


def _tokenizer_family(ix: ScriptIndex) -> str | None:
    """The model_type of the tokenizer the script loads (from its id, else the script's model)."""
    names = []
    for c in ix.calls:
        if c.tail == "from_pretrained" and "Tokenizer" in c.receiver:
            value = ix.value(c.arg(0) if c.arg(0) is not None else c.kw("pretrained_model_name_or_path"))
            if isinstance(value, str):
                names.append(catalog_name(value))
    names.append(script_catalog_model(ix))
    name = next((n for n in names if n), None)
    if name is None:
        return None
    if name in model_catalog():
        return model_catalog()[name]["config"].get("model_type")
    # `--model FOLDER` (or a config.json, a Hub id): the model_type its config.json names
    try:
        return resolve_model_source(name).model_type or None
    except FituneError:
        return None


LABEL_MAKING_COLLATORS_NOT = ("DataCollatorWithPadding", "default_data_collator", "DefaultDataCollator")
"""Collators that pad or stack what the examples hold and add no `labels` (transformers/data/data_collator.py)."""


@rule("trainer-without-labels", ERROR, "transformers Trainer on examples that never get labels")
def trainer_without_labels(ix: ScriptIndex) -> Iterator[Hit]:
    """The script tokenizes its own text and hands it to transformers' `Trainer` (not a subclass, which may compute
    its own loss), with no collator that makes labels and no `labels` anywhere in the script: the model then returns
    no loss and the Trainer raises at the first step."""
    if not tokenizer_calls(ix) or ix.calls_named("load_from_disk"):
        return  # the examples come from elsewhere, already tokenized: they may carry labels
    trainers = [c for c in ix.calls if c.tail == "Trainer" and c.receiver in ("", "transformers")]
    for c in trainers:
        if c.open_kwargs or c.has_kw("compute_loss_func") or len(c.node.args) > 2:
            continue
        collator = c.kw("data_collator")
        if collator is not None:
            made_by = collator.func if isinstance(collator, ast.Call) else collator
            if ix.dotted(made_by).rsplit(".", 1)[-1] not in LABEL_MAKING_COLLATORS_NOT:
                continue  # DataCollatorForLanguageModeling makes labels; a collator of the script's own may too
        if _mentions_labels(ix.tree):
            return
        yield Hit(
            c.line,
            f"`{call_text(c)}` trains on examples that never get labels: the tokenizer gives input_ids and "
            "attention_mask, the collator "
            + ("given adds none" if collator is not None else "the Trainer picks when none is given adds none")
            + ", so the first step fails: the model returns no loss and the Trainer raises `ValueError: The model "
            "did not return a loss from the inputs` (with the default collator, examples of different lengths fail "
            "even earlier, when it stacks them).",
            "data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False) (labels are a copy of input_ids, "
            "padding set to -100), or add labels in your tokenize function (a copy of input_ids with the prompt's "
            "positions set to -100 to train on answers only)",
            "source: transformers/trainer.py compute_loss raises 'The model did not return a loss from the inputs' "
            "when a batch has no labels; DataCollatorWithPadding and default_data_collator pass through the keys the "
            "examples have (transformers/data/data_collator.py)",
        )
        return


def _mentions_labels(tree: ast.AST) -> bool:
    """Whether the script touches labels anywhere: a "labels" / "label" key, a `labels=` keyword, a name or attribute
    with `label` in it. Any of these and the rule stays silent (it cannot follow data through the script)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ("labels", "label"):
            return True
        if isinstance(node, ast.keyword) and node.arg and "label" in node.arg:
            return True
        if isinstance(node, ast.Name) and "label" in node.id.lower():
            return True
        if isinstance(node, ast.Attribute) and "label" in node.attr.lower():
            return True
    return False


RULES = (pad_to_max_length, tokenize_without_truncation, labels_concatenate_inputs, sft_without_packing,
         missing_pad_token, trainer_without_labels)
