"""Records of every format turned into the three shapes the encoder tokenizes: chat, completion, text.

`normalise(fmt, record, chat_template)` runs before the encoder sees a record, so the encoder knows only
{"messages": [...]} (rendered with the tokenizer's chat template, the loss on the assistant turns),
{"prompt", "completion"} (strings: the loss on the completion) and {"text"}:

- chat, completion, text: passed on (only the fields the encoder reads);
- alpaca {instruction, input, output, system?}: with a chat template, chat messages - an optional system message,
  user = instruction + "\\n\\n" + input when input is non-empty, else instruction; assistant = output. Without one,
  a completion whose prompt is Stanford Alpaca's (`ALPACA_PROMPT`), the system text (if any) and a blank line before
  it, and whose completion is the output;
- sharegpt {conversations: [{from, value}], system?}: chat messages, the roles mapped by `SHAREGPT_ROLES`;
- conversational_completion {prompt: [messages], completion: [messages]}: chat messages prompt + completion, with
  "trained_from" = len(prompt): the encoder trains only the assistant messages from there on.

A record without its format's fields raises `ShapeProblem` (the encoder reports it as a "malformed" RecordProblem
with the record's number). Pure Python.
"""

from __future__ import annotations

from .read import json_type

ALPACA_PROMPT = {
    "prompt_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    ),
    "prompt_no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
}
"""The Stanford Alpaca prompt, verbatim: `PROMPT_DICT` in train.py of github.com/tatsu-lab/stanford_alpaca (its
training appends the output, then eos, right after "### Response:"; so does fitune's completion encoding)."""

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
"""ShareGPT speaker names (the "from" field, or "role") and the chat role each becomes. The assistant names are
those of the ShareGPT dumps (ChatGPT, Bing, Bard) and Gemini's "model"."""

TRAINED_FROM = "trained_from"
"""The key of a normalised chat record that trains only the assistant messages at and after this index."""


class ShapeProblem(Exception):
    """What is wrong with one record's fields for its format; said without the record's number."""


def needs_chat_template(fmt: str, chat_template: bool) -> bool:
    """Whether records of `fmt` are rendered with the tokenizer's chat template (alpaca only when there is one)."""
    if fmt == "alpaca":
        return chat_template
    return fmt in ("chat", "sharegpt", "conversational_completion")


def normalise(fmt: str, record: dict, chat_template: bool) -> tuple[str, dict]:
    """(shape, record) the encoder tokenizes: shape is "chat", "completion" or "text".

    Args:
        fmt: one of `fitune.data.formats.FORMATS`.
        record: one record as read.
        chat_template: the tokenizer has a chat template (decides how alpaca records are written).

    Raises:
        ShapeProblem: the record lacks its format's fields, or a field has the wrong type.
    """
    if fmt == "chat":
        return "chat", {"messages": _messages(record, "messages")}
    if fmt == "completion":
        prompt, completion = string_field(record, "prompt"), string_field(record, "completion")
        return "completion", {"prompt": prompt, "completion": completion}
    if fmt == "text":
        return "text", {"text": string_field(record, "text")}
    if fmt == "alpaca":
        return _alpaca(record, chat_template)
    if fmt == "sharegpt":
        return "chat", {"messages": _sharegpt(record)}
    if fmt == "conversational_completion":
        prompt, completion = _messages(record, "prompt"), _messages(record, "completion")
        return "chat", {"messages": prompt + completion, TRAINED_FROM: len(prompt)}
    raise ValueError(f"normalise: unknown format {fmt!r}")  # callers check fmt against FORMATS first


def _alpaca(record: dict, chat_template: bool) -> tuple[str, dict]:
    instruction, output = string_field(record, "instruction"), string_field(record, "output")
    extra = _optional_string(record, "input")
    system = _optional_string(record, "system")
    if chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return "chat", {"messages": messages}
    if extra:
        prompt = ALPACA_PROMPT["prompt_input"].format(instruction=instruction, input=extra)
    else:
        prompt = ALPACA_PROMPT["prompt_no_input"].format(instruction=instruction)
    if system:
        prompt = f"{system}\n\n{prompt}"
    return "completion", {"prompt": prompt, "completion": output}


def alpaca_prompt(record: dict, chat_template: bool) -> str | list[dict]:
    """The prompt of an alpaca record as training renders it (`_alpaca`), without the answer: the system and user
    messages with a chat template, else the Alpaca prompt text. An "output", if there, is left out.

    Raises:
        ShapeProblem: no string "instruction", or an "input" / "system" that is not a string.
    """
    kind, row = _alpaca({**record, "output": ""}, chat_template)
    return row["messages"][:-1] if kind == "chat" else row["prompt"]


def _sharegpt(record: dict) -> list[dict]:
    turns = record.get("conversations")
    if "conversations" not in record:
        raise ShapeProblem(f"missing field 'conversations' (keys found: {sorted(record)})")
    if not isinstance(turns, list) or not turns:
        raise ShapeProblem('field \'conversations\' must be a non-empty list of {"from": ..., "value": ...}')
    system = _optional_string(record, "system")
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ShapeProblem(f"conversations[{i}] is a {json_type(turn)}, not an object {{\"from\", \"value\"}}")
        speaker_key, text_key = ("from", "value") if "from" in turn or "value" in turn else ("role", "content")
        for key in (speaker_key, text_key):
            if key not in turn:
                raise ShapeProblem(f"missing field '{key}' in conversations[{i}] (keys found: {sorted(turn)})")
            if not isinstance(turn[key], str):
                raise ShapeProblem(f"conversations[{i}].{key} is a {json_type(turn[key])}, not a string")
        speaker = turn[speaker_key]
        role = SHAREGPT_ROLES.get(speaker.strip().lower())
        if role is None:
            raise ShapeProblem(
                f"conversations[{i}].{speaker_key} is {speaker!r}, not a role fitune knows; known: "
                f"{', '.join(SHAREGPT_ROLES)}; rename it (tool or function turns: drop them or write the records "
                "as format chat)"
            )
        messages.append({"role": role, "content": turn[text_key]})
    return messages


def string_field(record: dict, name: str) -> str:
    """The string field `name` of `record`.

    Raises:
        ShapeProblem: it is missing or not a string.
    """
    if name not in record:
        raise ShapeProblem(f"missing field '{name}' (keys found: {sorted(record)})")
    value = record[name]
    if not isinstance(value, str):
        hint = "; for conversations use format chat" if isinstance(value, list) else ""
        raise ShapeProblem(f"field '{name}' is a {json_type(value)}, not a string{hint}")
    return value


def _optional_string(record: dict, name: str) -> str:
    """A field that may be missing or null (parquet and CSV write empty cells so): "" then."""
    value = record.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ShapeProblem(f"field '{name}' is a {json_type(value)}, not a string")
    return value


def _messages(record: dict, name: str) -> list[dict]:
    if name not in record:
        raise ShapeProblem(f"missing field '{name}' (keys found: {sorted(record)})")
    messages = record[name]
    if not isinstance(messages, list) or not messages:
        raise ShapeProblem(f"field '{name}' must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ShapeProblem(f"{name}[{i}] is a {json_type(message)}, not an object {{\"role\", \"content\"}}")
        for key in ("role", "content"):
            if key not in message:
                raise ShapeProblem(f"missing field '{key}' in {name}[{i}] (keys found: {sorted(message)})")
            if not isinstance(message[key], str):
                raise ShapeProblem(f"{name}[{i}].{key} is a {json_type(message[key])}, not a string")
    return messages  # as written: a template may read more keys than role and content
