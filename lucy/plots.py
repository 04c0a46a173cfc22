"""`lucy bench --plot FILE` (tok/s against prompt length and context) and `lucy eval --plot FILE`
(KL divergence against bits per weight, a point per file): PNG charts with matplotlib's Agg
backend (no display needed). matplotlib is the optional ``plot`` extra; without it --plot is
refused before any model loads."""

from __future__ import annotations

from pathlib import Path

from poly.errors import UsageError

INSTALL_HINT = "--plot needs matplotlib: pip install 'polyloom[plot]'"
SIZE_IN, DPI = (8.0, 4.5), 100  # 800 x 450 pixels
PREFILL_COLOR, DECODE_COLOR, EVAL_COLOR = "#1f5fbf", "#d9730d", "#c0392b"


def require(path: str) -> Path:
    """The checked --plot path: matplotlib importable, a .png name, an existing directory."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    out = Path(path).expanduser()
    if out.suffix.lower() != ".png":
        raise UsageError(f"--plot writes a PNG file: {path} does not end in .png")
    if not out.parent.is_dir():
        raise UsageError(f"--plot: directory {out.parent} does not exist")
    return out


def _figure():
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend chosen

    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    return fig, [fig.subplots()]


def save(fig, path: str | Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    try:
        fig.savefig(str(path), format="png", dpi=DPI)
    except OSError as err:
        raise UsageError(f"cannot write plot {path}: {err.strerror or err}") from None


def bench_figure(result: dict):
    """Prefill tok/s against prompt length and decode tok/s against the context it runs after
    (`result["sweep"]`, one point per length; log-2 axis of lengths)."""
    fig, (ax,) = _figure()
    rows = result["sweep"]
    lengths = [r["prompt_tokens"] for r in rows]
    for label, key, color in (("prefill (prompt of N tokens)", "prefill_tok_s", PREFILL_COLOR),
                              ("decode (after N tokens of context)", "decode_tok_s", DECODE_COLOR)):  # fmt: skip
        ax.plot(lengths, [r[key] for r in rows], marker="o", color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt length / context N (tokens)")
    ax.set_ylabel("tokens per second")
    ax.set_title(f"lucy bench: {Path(str(result.get('model', ''))).name} — "
                 f"{result['new_tokens']} new tokens, medians of {result['runs']} runs")  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    return fig


def eval_figure(points: list[dict], reference: str | None):
    """One point per evaluated file: its mean KL divergence from `reference` (its perplexity
    without one) against its bits per weight, each point named by its file."""
    fig, (ax,) = _figure()
    key, label = ("kld_mean", "mean KL divergence (nats)") if reference else ("ppl", "perplexity")
    xs = [p["bpw"] for p in points]
    ys = [p[key] for p in points]
    err = [p.get("kld_stderr") or 0.0 for p in points] if reference else None
    ax.errorbar(xs, ys, yerr=err, fmt="o", color=EVAL_COLOR, capsize=3)
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(Path(str(p["model"])).name, (x, y), textcoords="offset points", xytext=(5, 5),
                    fontsize=8)  # fmt: skip
    ax.margins(x=0.12, y=0.1)  # room for the names beside the outer points
    ax.set_xlabel("bits per weight (file size × 8 / parameters)")
    ax.set_ylabel(label)
    title = "lucy eval" + (f": against {Path(reference).name}" if reference else "")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig
