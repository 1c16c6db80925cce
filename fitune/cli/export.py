"""`fitune export SOURCE --gguf f16|q8_0 --out FILE.gguf`: a trained model as one GGUF file for llama.cpp and Ollama."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from ..errors import FituneError
from ..units import GiB

DESCRIPTION = """\
Write a model as one GGUF file that llama.cpp and Ollama run: its weights (f16, or q8_0: 8-bit blocks, about half
the size), its tokenizer and its chat template, as llama.cpp's own converter (convert_hf_to_gguf.py) writes them.

SOURCE is one of:
  a fitune run folder   (the output_dir of `fitune train`): its merged/ or model/ weights when the run wrote them,
                        else its adapter merged into the base model first (in a temporary folder beside --out,
                        removed afterwards; it needs the base model and room for its full weights)
  a model folder        config.json, model*.safetensors and tokenizer.json (a `fitune merge` output, a base model)

Architectures: LlamaForCausalLM, MistralForCausalLM (written as GGUF "llama", as llama.cpp does) and
Qwen2ForCausalLM. Tokenizers: byte-level BPE from tokenizer.json with the pre-tokenizers llama-bpe (Llama 3), qwen2,
smollm, tekken (Mistral Nemo) and gpt-2, and SentencePiece-style BPE from tokenizer.json (Llama 2, Mistral 7B
v0.1-v0.3: written as GGUF "llama"; a folder with only tokenizer.model is refused). Tied
embeddings are written once (no output.weight), norms and biases stay f32, and under q8_0 a matrix whose rows are
not a multiple of 32 values stays f16 (all as llama.cpp does). Measured on SmolLM2-135M against transformers:
f16 logits within 0.04 (the same top token everywhere), q8_0 within 1.8 (the same top token at 74 of 76
positions); docs/export.md.

The file is written as a temporary file beside --out and renamed at the end: an interrupted export leaves no
half-written FILE.gguf. An existing --out is refused unless --force; a symbolic link, FIFO or device there is
refused even with --force (fitune never writes through a link or replaces a device).

exit codes: 0 written, 2 a problem with SOURCE or --out (the message says what to do).

examples:
  fitune export runs/smollm-lora --gguf q8_0 --out smollm-chat.q8_0.gguf
  fitune export runs/smollm-lora/merged --gguf f16 --out smollm-chat.f16.gguf --force

run it next (those tools' own commands; see docs/export.md):
  llama-cli -m smollm-chat.q8_0.gguf -cnv               chat in the terminal (llama.cpp)
  llama-server -m smollm-chat.q8_0.gguf                 an OpenAI-compatible server on :8080 (llama.cpp)
  echo 'FROM ./smollm-chat.q8_0.gguf' > Modelfile && ollama create smollm-chat -f Modelfile && ollama run smollm-chat
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a trained model as a GGUF file for llama.cpp and Ollama",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help="a fitune run folder (output_dir) or a Hugging Face model folder")
    p.add_argument("--gguf", required=True, choices=("f16", "q8_0"), metavar="f16|q8_0",
                   help="the tensor type: f16 (half precision, 2 bytes a weight) or q8_0 (8-bit, ~1.06 bytes a "
                        "weight, close to f16's outputs)")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="the file to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--name", metavar="NAME", help="general.name written in the file (default: SOURCE's folder name)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from ..export.gguf import ExportError, check_output_path, export_gguf
    from .progress import progress_callback

    out = os.path.abspath(args.out)
    check_output_path(out, args.force)  # before a merge that may take minutes
    name = args.name or os.path.basename(os.path.normpath(os.path.abspath(args.source)))
    folder, merge_from = _model_folder(args.source, ExportError)
    tmp = None
    try:
        if merge_from is not None:
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.merge-", dir=os.path.dirname(out))
            folder = os.path.join(tmp, "merged")
            print(f"fitune export: merging the adapter of {merge_from} into its base model ({folder})",
                  file=sys.stderr)
            _merge(merge_from, folder)
        with progress_callback("export: writing tensors", "tensor") as progress:
            result = export_gguf(folder, out, args.gguf, overwrite=args.force, name=name, progress=progress)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    types = ", ".join(f"{count} {kind.lower()}" for kind, count in sorted(result["tensor_types"].items()))
    tok = result["tokenizer"]
    print(f"wrote {result['path']}: {result['bytes'] / GiB:.2f} GiB, {result['architecture']}, {args.gguf} "
          f"({result['tensors']} tensors: {types}), {result['parameters'] / 1e6:.1f}M parameters")
    print(f"  tokenizer: {tok['model']} / {tok['pre']}, {tok['tokens']} tokens, chat template "
          f"{'included' if tok['chat_template'] else 'none (the folder has none: llama.cpp falls back to its own)'}")
    for note in result["notes"]:
        print(f"  note: {note}")
    path = result["path"]
    print("run it:")
    print(f"  llama-cli -m {path} -cnv")
    print(f"  llama-server -m {path}")
    print(f"  ollama: a Modelfile with `FROM {path}`, then `ollama create NAME -f Modelfile` and `ollama run NAME`")
    return 0


def _model_folder(source: str, error) -> tuple[str, str | None]:
    """(the folder of full weights to export, None) or (None, the run folder whose adapter must be merged first)."""
    from ..infer.load import describe_folder

    if os.path.isfile(source) and source.endswith(".gguf"):
        raise error(f"{source} is already a GGUF file; give the run folder or model folder it was made from")
    try:
        info = describe_folder(source)
    except FituneError as exc:
        raise error(str(exc)) from exc
    if info.weights in ("merged", "model"):
        return info.weights_dir, None
    if info.weights == "adapter":
        merged = os.path.join(info.path, "merged")
        if info.kind == "run" and os.path.isfile(os.path.join(merged, "config.json")):
            return merged, None  # the run wrote its merged weights already (merge: true)
        return "", info.path
    raise error(f"{source}: {info.describe()} cannot be exported; give a run folder or a model folder")


def _merge(run_dir: str, out_dir: str) -> None:
    """The run's (or PEFT adapter folder's) adapter merged into its base, written to `out_dir` as full weights."""
    from ..infer.merge import merge_run

    merge_run(run_dir, out_dir)
