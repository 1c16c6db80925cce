"""`--plot FILE.png`: live memory over the measured steps, phases shaded, the peak marked with its top categories."""

from __future__ import annotations

from ..units import GiB

PHASE_COLOURS = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer": "#e3f1dc"}


def plot_timeline(result, path: str) -> str:
    """Write a PNG of `result.timeline`; returns the path. Needs matplotlib."""
    # matplotlib: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline
    if not tl:
        raise ValueError("nothing to plot: the run recorded no allocations")
    gib = GiB
    t = [x[0] for x in tl]
    live = [x[2] / gib for x in tl]
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=120)
    # shade phases
    start, cur = t[0], tl[0][1]
    for (ti, ph, _), nxt in zip(tl, tl[1:] + [(t[-1], None, 0)]):
        if nxt[1] != cur:
            ax.axvspan(start, nxt[0], color=PHASE_COLOURS.get(cur, "#f0f0f0"), lw=0)
            start, cur = nxt[0], nxt[1]
    ax.step(t, live, where="post", color="#1f4e79", lw=1.0, label="live tensors (tracked)")
    i = max(range(len(live)), key=live.__getitem__)
    top = sorted(((k, v) for k, v in result.breakdown.items() if v), key=lambda kv: -kv[1])[:3]
    note = "\n".join(f"{k.replace('_', ' ')} {v / gib:.2f} GiB" for k, v in top)
    ax.annotate(f"peak {live[i]:.2f} GiB ({result.peak_phase})\n{note}", xy=(t[i], live[i]),
                xytext=(0.02, 0.97), textcoords="axes fraction", va="top", fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "#a00"})
    ax.plot([t[i]], [live[i]], "o", color="#a00")
    if result.cap_bytes:
        ax.axhline(result.cap_bytes / gib, color="#a00", ls="--", lw=0.8, label="cap")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items()]
    ax.legend(handles=ax.get_legend_handles_labels()[0] + handles, loc="lower right", fontsize=7)
    s = result.setup
    ax.set_title(f"{result.model}: {s.method} r{s.lora_rank}, {s.batch_size} x {s.seq_len_tokens} tokens, "
                 f"checkpointing {s.grad_checkpointing}, {result.steps} steps on {result.device}", fontsize=9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
