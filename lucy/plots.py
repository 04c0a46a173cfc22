"""`lucy bench --plot FILE` and `lucy eval --plot FILE`: PNG charts with matplotlib's Agg backend
(no display needed). matplotlib is the optional ``plot`` extra; without it --plot is refused
before any model loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from poly.errors import UsageError

INSTALL_HINT = "--plot needs matplotlib: pip install 'polyloom[plot]'"
SIZE_IN, DPI = (8.0, 4.5), 100  # 800 x 450 pixels


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


def _figure(rows: int = 1):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend chosen

    fig = Figure(figsize=(SIZE_IN[0], SIZE_IN[1] * (1 if rows == 1 else 1.5)), dpi=DPI)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def save(fig, path: str | Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    try:
        fig.savefig(str(path), format="png", dpi=DPI)
    except OSError as err:
        raise UsageError(f"cannot write plot {path}: {err.strerror or err}") from None


def bench_figure(result: dict):
    """Prefill and decode tok/s of each timed run (bars), their medians (dashed lines)."""
    fig, (ax,) = _figure()
    runs = np.arange(1, len(result["decode_runs_tok_s"]) + 1)
    phases = (("prefill", "prefill_runs_tok_s", "prefill_tok_s", "#1f5fbf"),
              ("decode", "decode_runs_tok_s", "decode_tok_s", "#d9730d"))  # fmt: skip
    for k, (label, runs_key, median_key, color) in enumerate(phases):
        ax.bar(runs + (k - 0.5) * 0.38, result[runs_key], width=0.38, color=color,
               label=f"{label} ({result[median_key]:.1f} tok/s median)")  # fmt: skip
        ax.axhline(result[median_key], color=color, linestyle="--", linewidth=1)
    ax.set_xticks(runs)
    ax.set_xlabel("timed run")
    ax.set_ylabel("tokens per second")
    ax.set_title(f"lucy bench: {Path(str(result.get('model', ''))).name} — "
                 f"{result['prompt_tokens']} prompt tokens, {result['new_tokens']} new")  # fmt: skip
    top = max(result["prefill_runs_tok_s"] + result["decode_runs_tok_s"])
    ax.set_ylim(0, top * 1.25)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return fig


def eval_figure(measure, title: str):
    """Per window (chunk) of the text: mean negative log-likelihood of the model (and of the
    reference), and with a reference the mean KL divergence, each against the window's index."""
    scored = measure.scored
    windows = np.arange(1, len(scored) + 1)
    has_ref = bool(scored) and scored[0].kld is not None
    fig, axes = _figure(2 if has_ref else 1)
    ax = axes[0]
    ax.plot(windows, [w.nll.mean() for w in scored], marker="o", label="model")
    if has_ref:
        ax.plot(
            windows,
            [w.ref_nll.mean() for w in scored],
            marker="s",
            linestyle="--",
            label="reference",
        )  # dashed: a near-equal model's line still shows under it
    ax.set_ylabel("mean NLL (nats/token)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if has_ref:
        kld = axes[1]
        kld.plot(windows, [w.kld.mean() for w in scored], marker="o", color="#c0392b")
        kld.set_ylabel("mean KL divergence (nats)")
        kld.grid(alpha=0.3)
    axes[-1].set_xlabel("window of the text (scored half of each)")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    return fig
