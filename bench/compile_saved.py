"""What a compiled decoder layer saves for backward, tensor by tensor (issue 14: the estimator's model of
`compile: layers`, fitune/memory/layers.py). One decoder layer of the named catalog model, random weights, LoRA as
given, fitune's runner techniques via `prepare_model`; the layer's forward under `saved_tensors_hooks`, eager and
compiled, on the device given. Writes one JSON line per mode: each saved storage (shape, dtype, bytes) other than
the layer's parameters, its input and the RoPE tables, and the total per token.

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/compile_saved.py --model llama-3.1-8b --tokens 2048 --out $OUT/compile_saved.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import write_record  # noqa: E402


def saved_by_layer(model, layer, tokens: int, hidden: int, device: str, dtype) -> list[dict]:
    import torch

    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(tokens, device=device).unsqueeze(0)
    inner = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    cos, sin = inner.rotary_emb(x, pos)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (x, cos, sin)}
    items: dict[int, dict] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            items[st.data_ptr()] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                    "bytes": st.nbytes()}
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    y = out[0] if isinstance(out, tuple) else out
    y.float().pow(2).mean().backward()  # the backward runs too (a compiled backward compiles here)
    return sorted(items.values(), key=lambda d: -d["bytes"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    from fitune.runtime.layers import find_decoder_layers
    from fitune.runtime.model import build_model, prepare_model
    from fitune.setup import TrainSetup
    from fitune.specs.model import load_model_spec, model_spec_from_hf_config

    spec = load_model_spec(args.model)
    one = model_spec_from_hf_config(dict(spec.hf_config, num_hidden_layers=1), name=args.model + "-1layer")
    for mode in ("eager", "compiled"):
        s = TrainSetup(method="lora", lora_targets=tuple(args.targets.split(",")), lean_lora=True, stack="fitune",
                       compile="layers" if mode == "compiled" else "none", loss="chunked")
        model = prepare_model(build_model(one, dtype_name="bf16", attn="sdpa", device=args.device, init="random"), s)
        layer = find_decoder_layers(model)[0]
        saved = saved_by_layer(model, layer, args.tokens, spec.hidden_size, args.device, torch.bfloat16)
        total = sum(d["bytes"] for d in saved)
        rec = {"model": args.model, "mode": mode, "tokens": args.tokens, "targets": args.targets,
               "device": args.device, "saved_bytes": total, "saved_bytes_per_token": total / args.tokens,
               "saved": saved, "torch": torch.__version__}
        write_record(args.out, rec)
        print(mode, round(total / args.tokens), [(d["shape"], d["dtype"]) for d in saved][:16], flush=True)
        del model, layer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
