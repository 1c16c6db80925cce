"""Generation with a loaded model: prompts through the chat template, batches with left padding, a chat session.

    render_prompt(tokenizer, prompt)       a string (one user message) or a list of messages -> the text the model
                                           sees, with the assistant's header at the end (the chat template's
                                           generation prompt); `raw=True` sends a string as it is
    iter_generate(model, tok, prompts)     the responses (Generation), `batch_size` prompts at a time
    generate_batch(model, tok, prompts)    the same as a list
    ChatSession(model, tok)                the conversation so far; `send(text, on_text)` streams the reply

Greedy by default (temperature 0): the same tokens as `model.generate` on each prompt alone, since left padding
is masked out and the positions count from each prompt's first real token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError



@dataclass(frozen=True)
class GenerationSettings:
    """How to sample. Defaults: greedy, up to 256 new tokens."""

    max_new_tokens: int = 256
    """The most tokens generated per response (the end-of-turn token included)."""
    temperature: float = 0.0
    """0: greedy (the most likely token each time); above 0: sampling at this temperature."""
    top_p: float = 1.0
    """Sampling only: keep the smallest set of tokens whose probabilities add up to top_p."""

    def validate(self) -> "GenerationSettings":
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"--max-new-tokens {self.max_new_tokens}: give at least 1")
        if not self.temperature >= 0:
            problems.append(f"--temperature {self.temperature}: give 0 (greedy) or more (sampling; 0.7 is common)")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top-p {self.top_p}: give a value in (0, 1] (1 keeps every token; 0.9 is common)")
        if problems:
            raise ConfigError(problems)
        return self

    def generate_kwargs(self) -> dict:
        """`model.generate` arguments; greedy clears the sampling knobs a generation_config.json may set."""
        if self.temperature == 0:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False, "temperature": None, "top_p": None,
                    "top_k": None}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": None}


@dataclass(frozen=True)
class Generation:
    """One prompt's response."""

    prompt: Any
    """The prompt as given (a string or a list of messages)."""
    response: str
    """The generated text, up to (without) the end-of-turn / eos token, special tokens removed."""
    new_tokens: int
    """Tokens generated, the stop token included (max_new_tokens when it was cut short)."""
    finished: bool
    """Whether the model ended the response itself (a stop token) rather than hitting max_new_tokens."""

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "response": self.response, "new_tokens": self.new_tokens,
                "finished": self.finished}


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, prompt, *, raw: bool = False) -> tuple[str, bool]:
    """(text, add_special_tokens): what the model is given for `prompt`.

    A list of messages goes through the chat template (with the generation prompt); so does a string, as one user
    message, when the tokenizer has a template and `raw` is False; otherwise the string is sent as it is, with the
    tokenizer's own special tokens (a BOS) added when it is tokenized.

    Raises:
        ConfigError: messages without a chat template, or messages the template cannot render.
    """
    if isinstance(prompt, str) and (raw or not has_chat_template(tokenizer)):
        return prompt, True
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not has_chat_template(tokenizer):
        raise ConfigError(f"the prompt is a list of messages but the tokenizer {tokenizer.name_or_path} has no chat "
                          "template; give plain prompt strings (they are sent as text), or use a chat model's "
                          "tokenizer")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception(...)
        raise ConfigError(f"the chat template cannot render these messages ({exc}); check the roles (system, user, "
                          "assistant) and their order") from None
    return text, False  # the template writes the special tokens it wants (a BOS included)


def stop_token_ids(model, tokenizer) -> set[int]:
    """The ids that end a response: the generation config's eos ids (ChatML's <|im_end|>) and the tokenizer's eos."""
    found = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    return found


def iter_generate(model, tokenizer, prompts: Sequence, settings: GenerationSettings = GenerationSettings(), *,
                  raw: bool = False, batch_size: int = 8) -> Iterator[Generation]:
    """The responses to `prompts` in order, yielded a batch at a time (`batch_size` prompts, left padding: every
    prompt ends where generation starts)."""
    # torch, transformers: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    import torch

    settings.validate()
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: give at least 1")
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    pad_id = _pad_id(tokenizer, stops)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        rows = []
        for prompt in chunk:
            text, special = render_prompt(tokenizer, prompt, raw=raw)
            rows.append(list(tokenizer(text, add_special_tokens=special)["input_ids"]))
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.no_grad():
            generated = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad_id,
                                       **settings.generate_kwargs())
        for prompt, new in zip(chunk, generated[:, width:].tolist()):
            yield _response(prompt, new, stops, tokenizer)


def generate_batch(model, tokenizer, prompts: Sequence, settings: GenerationSettings = GenerationSettings(), *,
                   raw: bool = False, batch_size: int = 8) -> list[Generation]:
    """`iter_generate` as a list."""
    return list(iter_generate(model, tokenizer, prompts, settings, raw=raw, batch_size=batch_size))


def _pad_id(tokenizer, stops: set[int]) -> int:
    """Left padding is masked out, so any id will do: the tokenizer's pad token, else a stop token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)


def _response(prompt, new: list[int], stops: set[int], tokenizer) -> Generation:
    """A response's tokens cut at its first stop token (what follows is padding)."""
    end = next((i for i, t in enumerate(new) if t in stops), None)
    kept = new if end is None else new[:end]
    return Generation(prompt=prompt, response=tokenizer.decode(kept, skip_special_tokens=True),
                      new_tokens=len(new) if end is None else end + 1, finished=end is not None)


class ChatSession:
    """A conversation with the model: the messages so far (a system message first, when given)."""

    def __init__(self, model, tokenizer, settings: GenerationSettings = GenerationSettings(),
                 system: str | None = None):
        if not has_chat_template(tokenizer):
            raise ConfigError(f"fitune chat needs a chat template, and the tokenizer {tokenizer.name_or_path} has "
                              "none (a base model, not an instruct one); use `fitune generate --raw` for plain text "
                              "completion, or add a chat_template to tokenizer_config.json")
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings.validate()
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str, on_text: Callable[[str], None] | None = None) -> Generation:
        """Add the user's `text`, generate the reply (each piece of decoded text passed to `on_text` as it is
        generated), add the reply to the conversation and return it. A reply cut short by Ctrl-C is not kept."""
        import torch
        from transformers import TextStreamer

        class _Streamer(TextStreamer):
            def on_finalized_text(self, piece: str, stream_end: bool = False) -> None:
                if on_text is not None and piece:
                    on_text(piece)

        messages = self.messages + [{"role": "user", "content": text}]
        prompt, special = render_prompt(self.tokenizer, messages)
        ids = self.tokenizer(prompt, add_special_tokens=special, return_tensors="pt")["input_ids"]
        ids = ids.to(next(self.model.parameters()).device)
        stops = stop_token_ids(self.model, self.tokenizer)
        pad_id = _pad_id(self.tokenizer, stops)
        streamer = _Streamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.no_grad():
            generated = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=pad_id,
                                            streamer=streamer, **self.settings.generate_kwargs())
        reply = _response(text, generated[0, ids.shape[1]:].tolist(), stops, self.tokenizer)
        self.messages = messages + [{"role": "assistant", "content": reply.response}]
        return reply
