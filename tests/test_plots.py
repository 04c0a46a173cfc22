"""`lucy bench --plot` and `lucy eval --plot` (issue 63): valid PNG files of the expected size
holding what the commands measured, labelled axes, and a one-line install hint without
matplotlib (the plot extra)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (a matplotlib dependency)

from lucy import plots  # noqa: E402
from poly.errors import UsageError  # noqa: E402
from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402

N_CTX = 32
TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
        "It was the best of times, it was the worst of times, it was the age of wisdom. ") * 6  # fmt: skip


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("plots")
    text = base / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return {"a": make_tiny_checkpoint(base / "a", "llama", seed=5),
            "b": make_tiny_checkpoint(base / "b", "llama", seed=6), "text": text}  # fmt: skip


def _lucy(capsys, *args) -> tuple[int, str, str]:
    """`lucy ARGS` in this process: (exit code, stdout, stderr)."""
    from lucy.cli import run

    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _png(path, size) -> np.ndarray:
    """The PNG's pixels (RGB), after PIL checked the file's structure and CRCs."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    assert (int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")) == size
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == size
        return np.asarray(im.convert("RGB"))


def _has_color(pixels: np.ndarray, hex_color: str) -> int:
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(pixels.astype(int) - rgb).sum(axis=-1) < 12).sum())


def test_bench_plot_draws_each_run(ckpts, tmp_path, capsys):
    out = tmp_path / "bench.png"
    code, stdout, err = _lucy(capsys, "bench", ckpts["a"], "--runs", 3, "--prompt-tokens", 16, "--new-tokens", 8,
                 "--json", "--plot", out)  # fmt: skip
    assert code == 0, err
    data = json.loads(stdout)
    assert len(data["prefill_runs_tok_s"]) == len(data["decode_runs_tok_s"]) == 3
    assert data["decode_tok_s"] == pytest.approx(np.median(data["decode_runs_tok_s"]))
    pixels = _png(out, (800, 450))
    assert _has_color(pixels, "#1f5fbf") > 500 and _has_color(pixels, "#d9730d") > 500  # both bars

    (ax,) = plots.bench_figure(data).axes
    assert ax.get_xlabel() == "timed run" and ax.get_ylabel() == "tokens per second"
    heights = [b.get_height() for b in ax.patches]
    assert heights == data["prefill_runs_tok_s"] + data["decode_runs_tok_s"]


def test_eval_plot_draws_nll_and_kld_per_window(ckpts, tmp_path, capsys):
    import entity
    from poly.text.evaluate import Measure, evaluate, text_tokens

    out = tmp_path / "eval.png"
    code, stdout, err = _lucy(capsys, "eval", ckpts["a"], "--reference", ckpts["b"], "--text", ckpts["text"],
                 "--ctx", N_CTX, "--json", "--plot", out)  # fmt: skip
    assert code == 0, err
    data = json.loads(stdout)
    pixels = _png(out, (800, 675))
    assert _has_color(pixels, "#c0392b") > 200  # the KLD curve

    a, b = entity.load(ckpts["a"]), entity.load(ckpts["b"])
    measure = Measure()
    evaluate(a, text_tokens(a, TEXT, b), reference=b, n_ctx=N_CTX, measure=measure)
    fig = plots.eval_figure(measure, "t")
    nll_ax, kld_ax = fig.axes
    assert nll_ax.get_ylabel().startswith("mean NLL") and kld_ax.get_ylabel().startswith("mean KL")
    assert kld_ax.get_xlabel().startswith("window")
    kld = kld_ax.lines[0].get_ydata()
    assert len(kld) == data["windows"] > 1
    assert np.mean(kld) == pytest.approx(data["kld_mean"], rel=1e-6)  # equal-sized windows
    model_nll = nll_ax.lines[0].get_ydata()
    assert np.exp(np.mean(model_nll)) == pytest.approx(data["ppl"], rel=1e-6)


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_without_matplotlib_one_line_hint(ckpts, tmp_path, monkeypatch, capsys, command):
    from lucy.cli import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "x.png"
    args = [command, str(ckpts["a"]), "--plot", str(out)]
    if command == "eval":
        args += ["--text", str(ckpts["text"]), "--ctx", str(N_CTX)]
    code = run(args)
    err = capsys.readouterr().err.strip()
    assert code == UsageError.exit_code
    assert err == f"lucy: error: {plots.INSTALL_HINT}"
    assert "pip install 'polyloom[plot]'" in err and not out.exists()


def test_plot_path_errors_are_one_line(ckpts, tmp_path, capsys):
    for path, needle in ((tmp_path / "x.jpg", "does not end in .png"),
                         (tmp_path / "no" / "x.png", "does not exist")):  # fmt: skip
        code, _, err = _lucy(capsys, "bench", ckpts["a"], "--plot", path)
        assert code == UsageError.exit_code
        assert err.startswith("lucy: error: --plot"), err
        assert len(err.strip().splitlines()) == 1 and needle in err
