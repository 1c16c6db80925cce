"""Which options of a setup rest on GPU measurements, and how close the estimate came where they were measured.

The evidence is fitune/specs/data/measured.json, written from the committed records under bench/results/ by
`python -m fitune.profile.accuracy --write-measured` (tests/test_estimator_accuracy.py checks that it is current). A plan
that turns on an option no measurement covers, or one where the estimate missed (peak allocated off by more than
ALLOCATED_LIMIT_PCT or reserved by more than RESERVED_LIMIT_PCT), is marked unvalidated with the reason.

Two kinds of evidence. A setup's *combination* of options (method, optimizer, dtype, kernels, loss, stack and
fitune's techniques; checkpointing and attention are left out, the recipe's 50 cases cover them) is backed by the
measured cases with exactly that combination. Its *architecture* is backed by the cases of the HF recipe's options
(LoRA / QLoRA, AdamW, bf16, transformers' loss) on a model of that `model_type`.

Pure Python, no torch.
"""

from __future__ import annotations

import functools
import json
import os

from ..setup import TrainSetup

ALLOCATED_LIMIT_PCT = 2.0
RESERVED_LIMIT_PCT = 5.0
MEASURED_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specs", "data",
                             "measured.json")

#: The HF recipe's options: a case with them on a new model_type is evidence for that architecture.
RECIPE = {"method": ("lora", "qlora"), "optimizer": ("adamw",), "dtype": ("bf16",), "kernels": ("torch",),
          "loss": ("hf",), "stack": ("hf",)}


def combination(s: TrainSetup) -> str:
    """The options of a setup that change its memory model, as one readable key."""
    techniques = [n.replace("_", "-") for n in ("tiled_mlp", "lean_lora", "lean_norm", "expandable_segments",
                                                 "keep_outputs", "offload_embeddings") if getattr(s, n)]
    if s.compile != "none":
        techniques.append(f"compile-{s.compile}")
    return (f"{s.method}, {s.optimizer}, {s.dtype}, kernels {s.kernels}, loss {s.loss}, stack {s.stack}"
            + (f", {' + '.join(techniques)}" if techniques else ""))


def _recipe_options(s: TrainSetup) -> bool:
    techniques = (s.tiled_mlp, s.lean_lora, s.lean_norm, s.expandable_segments, s.keep_outputs, s.compile != "none",
                  s.offload_embeddings)
    return all(getattr(s, k) in v for k, v in RECIPE.items()) and not any(techniques)


def evidence_of(cases: list[tuple[TrainSetup, str, float, float, str]]) -> dict:
    """{"combination": {key: entry}, "architecture": {model_type: entry}}, entry = {cases, allocated_max_pct,
    reserved_max_pct, sources}, from (setup, model_type, allocated error %, reserved error %, source file)."""
    out: dict[str, dict[str, dict]] = {"combination": {}, "architecture": {}}

    def add(axis: str, key: str, alloc_pct: float, resv_pct: float, source: str) -> None:
        e = out[axis].setdefault(key, {"cases": 0, "allocated_max_pct": 0.0, "reserved_max_pct": 0.0, "sources": []})
        e["cases"] += 1
        e["allocated_max_pct"] = round(max(e["allocated_max_pct"], abs(alloc_pct)), 2)
        e["reserved_max_pct"] = round(max(e["reserved_max_pct"], abs(resv_pct)), 2)
        if source not in e["sources"]:
            e["sources"].append(source)

    for s, mt, alloc_pct, resv_pct, source in cases:
        add("combination", combination(s), alloc_pct, resv_pct, source)
        if _recipe_options(s):
            add("architecture", mt, alloc_pct, resv_pct, source)
    return {a: dict(sorted(v.items())) for a, v in out.items()}


@functools.lru_cache(maxsize=1)
def load_evidence() -> dict:
    with open(MEASURED_PATH, encoding="utf-8") as f:
        return json.load(f)["options"]


def unmeasured_reasons(s: TrainSetup, model_type: str) -> list[str]:
    """Why a setup's estimate is not backed by a measurement: its combination of options, or its architecture, never
    measured, or measured with the estimate off by more than the limits."""
    ev = load_evidence()
    out = []
    for axis, key, what in (("combination", combination(s), "this combination of options"),
                            ("architecture", model_type, f"architecture {model_type}")):
        e = ev.get(axis, {}).get(key)
        if e is None:
            out.append(f"{what} ({key}) not measured on a GPU yet" if axis == "combination"
                       else f"{what}: not measured on a GPU yet")
        elif e["allocated_max_pct"] > ALLOCATED_LIMIT_PCT or e["reserved_max_pct"] > RESERVED_LIMIT_PCT:
            out.append(f"{what}: measured ({e['cases']} case{'s' if e['cases'] > 1 else ''}), the estimate off by up "
                       f"to {e['allocated_max_pct']:.1f} % allocated, {e['reserved_max_pct']:.1f} % reserved")
    return out
