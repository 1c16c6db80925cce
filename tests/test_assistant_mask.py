"""Loss on the assistant's tokens only, checked token for token against transformers' assistant mask.

fitune's chat labels (fitune.data.encode, on a model's own, unmarked chat template) against
`apply_chat_template(..., return_assistant_tokens_mask=True)` (what TRL's `assistant_only_loss=True` trains on) on a
copy of the same template with `{% generation %}` around what an assistant turn adds, the way TRL marks its training
templates. Five public templates (tests/fixtures/chat_templates/README.md says where each comes from): SmolLM2's real
one, Llama 3.1, Qwen2.5, Mistral v0.3 and Gemma 3, each on the real SmolLM2 BPE tokenizer with the template's special
tokens added. They agree except where fitune differs by design (docs/assistant_loss.md): it does not train the
whitespace a template writes after the end-of-turn token, nor Qwen2.5's header newline that TRL's Qwen2.5 template
marks, nor the first token (no logit scores it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from fitune.data.encode import IGNORE_INDEX, _Encoder, tokenize_records  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
SEQ_LEN = 4096  # longer than any conversation here: nothing is truncated


@dataclass(frozen=True)
class Template:
    name: str
    """The fixture: NAME.jinja as published, NAME_marked.jinja with {% generation %}."""
    end_of_turn: str
    """The token the model ends its turn with (where generation stops)."""
    specials: dict
    """Special tokens the template needs, added to the SmolLM2 tokenizer (bos, eos, the others)."""
    newline_after_end_of_turn: bool
    """The template writes "\\n" after end_of_turn and the marked copy (like TRL's) includes it in the turn."""
    header_newline_marked: bool = False
    """The marked copy (TRL's Qwen2.5) starts the turn before the "\\n" that ends the "<|im_start|>assistant" header."""


TEMPLATES = [
    # SmolLM2's own tokenizer already has <|im_start|> and <|im_end|> as special tokens
    Template("smollm2", "<|im_end|>", {}, newline_after_end_of_turn=True),
    Template(
        "llama3_1",
        "<|eot_id|>",
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
        },
        newline_after_end_of_turn=False,
    ),
    Template("qwen2_5", "<|im_end|>", {"eos_token": "<|im_end|>"}, newline_after_end_of_turn=True,
             header_newline_marked=True),
    Template(
        "mistral_v0_3",
        "</s>",
        {"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": ["[INST]", "[/INST]"]},
        newline_after_end_of_turn=False,
    ),
    Template(
        "gemma3",
        "<end_of_turn>",
        {"bos_token": "<bos>", "eos_token": "<eos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
        newline_after_end_of_turn=True,
    ),
]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


CONVERSATIONS = {
    "single turn": [user("What is 2+2?"), assistant("2+2 is 4.")],
    "multi-turn": [user("hi"), assistant("hello there"), user("how are you"), assistant("fine, thanks")],
    "system prompt": [{"role": "system", "content": "You are terse."}, user("Hi"), assistant("Hello!")],
    # Mistral v0.3 renders the system prompt only when the conversation ends on a user turn: here it vanishes, and
    # the text before an answer on its own (with the system prompt) is not a prefix of the whole
    "system prompt, multi-turn": [
        {"role": "system", "content": "Be nice."}, user("hi"), assistant("hello there"), user("how are you"),
        assistant("fine, thanks"),
    ],
    "one-character answer": [user("Yes or no?"), assistant("y")],
    "unicode": [user("Ça va? 日本語で"), assistant("Très bien — 元気です 🙂")],
    "same content in every turn": [
        {"role": "system", "content": "ok"}, user("ok"), assistant("ok"), user("ok"), assistant("ok"),
    ],
    "assistant turn not last": [user("hi"), assistant("hello"), user("bye")],
    "answers with surrounding whitespace": [user("hi"), assistant("  Sure.  \n"), user("again"), assistant("\nok\n\n")],
    "empty answer": [user("hi"), assistant("")],
}


@pytest.fixture(scope="module")
def base_tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def tokenizers(base_tokenizer):
    """One SmolLM2 tokenizer per template, the template's special tokens added, its unmarked template set."""
    import copy

    made = {}
    for template in TEMPLATES:
        tokenizer = copy.deepcopy(base_tokenizer)
        if template.specials:
            tokenizer.add_special_tokens(template.specials)
        tokenizer.chat_template = (FIXTURES / f"{template.name}.jinja").read_text(encoding="utf-8")
        made[template.name] = tokenizer
    return made


def marked(template):
    return (FIXTURES / f"{template.name}_marked.jinja").read_text(encoding="utf-8")


def fitune_labels(tokenizer, messages):
    (example,), stats = tokenize_records([(1, {"messages": messages})], tokenizer, "chat", SEQ_LEN)
    assert stats.truncated_records == 0
    return list(example.input_ids), list(example.labels)


def transformers_mask(tokenizer, template, messages):
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=marked(template)
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def untrained_by_design(template, tokens, mask):
    """Positions transformers' mask trains and fitune does not, by design (docs/assistant_loss.md), found from the
    tokens: in an assistant turn, the "\\n" after the end-of-turn token, and Qwen2.5's "\\n" after
    "<|im_start|>assistant" (when it is a token of its own). Returns (after end-of-turn, header) positions."""
    after_end, header = set(), set()
    for k in range(1, len(tokens)):
        if tokens[k] != "\n" or not mask[k]:
            continue
        if template.newline_after_end_of_turn and tokens[k - 1] == template.end_of_turn:
            after_end.add(k)
        if template.header_newline_marked and "".join(tokens[k - 3 : k]).endswith("<|im_start|>assistant"):
            header.add(k)
    return after_end, header


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_labels_equal_the_assistant_mask_except_by_design(tokenizers, template, conversation):
    tokenizer = tokenizers[template.name]
    messages = CONVERSATIONS[conversation]
    # the marked copy renders the very same text: the markers only say which characters an assistant turn adds
    assert tokenizer.apply_chat_template(messages, tokenize=False, chat_template=marked(template)) == (
        tokenizer.apply_chat_template(messages, tokenize=False)
    )
    ids, labels = fitune_labels(tokenizer, messages)
    mask_ids, mask = transformers_mask(tokenizer, template, messages)
    assert ids == mask_ids

    tokens = [tokenizer.decode([token_id]) for token_id in ids]
    after_end, header = untrained_by_design(template, tokens, mask)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    turns = len(answers)
    # each named difference is in the mask once per assistant turn, the header "\n" only where it is a token of its
    # own (an answer opening with "\n" merges with it into one "\n\n", which both train); fitune trains everything
    # else the mask trains
    assert len(after_end) == (turns if template.newline_after_end_of_turn else 0)
    assert len(header) == (sum(not a.startswith("\n") for a in answers) if template.header_newline_marked else 0)
    skipped = after_end | header
    assert mask[0] == 0  # the first-token rule never bites here: every template writes a prefix first
    expected = [token_id if mask[k] and k not in skipped else IGNORE_INDEX for k, token_id in enumerate(ids)]
    assert labels == expected
    # the model learns to stop: every assistant turn's end-of-turn token is trained
    end_of_turn_id = tokenizer.convert_tokens_to_ids(template.end_of_turn)
    assert sum(1 for label in labels if label == end_of_turn_id) == turns


TRAINED_TEXT = {
    # what the loss is on, for the single-turn conversation: the answer and the end-of-turn token, nothing else
    "smollm2": "2+2 is 4.<|im_end|>",
    "llama3_1": "2+2 is 4.<|eot_id|>",
    "qwen2_5": "2+2 is 4.<|im_end|>",
    "mistral_v0_3": " 2+2 is 4.</s>",  # the template writes " " before the answer; it is part of its first token
    "gemma3": "2+2 is 4.<end_of_turn>",
}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_single_turn_trains_the_answer_and_its_end_of_turn(tokenizers, template):
    tokenizer = tokenizers[template.name]
    _, labels = fitune_labels(tokenizer, CONVERSATIONS["single turn"])
    assert tokenizer.decode([label for label in labels if label != IGNORE_INDEX]) == TRAINED_TEXT[template.name]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_tokenizer_without_offsets_gives_the_same_labels(tokenizers, template, conversation):
    # A slow tokenizer has no offset mapping: fitune then finds the turns' tokens by tokenizing the text up to each
    # turn's edges. Same tokenizer, offsets path switched off: the same labels.
    tokenizer = tokenizers[template.name]
    record = {"messages": CONVERSATIONS[conversation]}
    encoder = _Encoder(tokenizer)
    with_offsets = encoder.chat(record)
    encoder.fast = False
    assert encoder.chat(record) == with_offsets


def test_first_token_is_never_trained_even_when_the_template_opens_on_the_answer(base_tokenizer):
    # A template that writes the assistant's words first: transformers' mask marks token 0, but no logit scores the
    # first token (labels shift left by one), so fitune leaves it -100 and counts one trained token fewer.
    import copy

    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ '<|im_start|>' + m.content + '<|im_end|>' }}{% endif %}{% endfor %}"
    )
    messages = [assistant("Hello, how can I help?"), user("bye")]
    ids, labels = fitune_labels(tokenizer, messages)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    mask_ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    assert ids == mask_ids and mask[0] == 1
    assert labels == [IGNORE_INDEX] + [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
    assert tokenizer.decode([label for label in labels if label != IGNORE_INDEX]) == ", how can I help?<|im_end|>"
