"""`lucy bench --plot` (tok/s against prompt length and context) and `lucy eval --plot` (KL
divergence against bits per weight, a point per file; issue 63): valid PNG files of the expected
size holding what the commands measured, labelled axes, and a one-line install hint without
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


def test_bench_plot_draws_tok_s_against_length(ckpts, tmp_path, capsys):
    out = tmp_path / "bench.png"
    code, stdout, err = _lucy(capsys, "bench", ckpts["a"], "--runs", 2, "--prompt-tokens", 16, "--new-tokens", 8,
                 "--lengths", 4, 16, 48, "--json", "--plot", out)  # fmt: skip
    assert code == 0, err
    data = json.loads(stdout)
    assert [r["prompt_tokens"] for r in data["sweep"]] == [4, 16, 48]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in data["sweep"])
    pixels = _png(out, (800, 450))
    assert (
        _has_color(pixels, plots.PREFILL_COLOR) > 100
        and _has_color(pixels, plots.DECODE_COLOR) > 100
    )

    (ax,) = plots.bench_figure(data).axes
    assert (
        ax.get_xlabel().startswith("prompt length / context")
        and ax.get_ylabel() == "tokens per second"
    )
    prefill, decode = ax.lines
    assert list(prefill.get_xdata()) == [4, 16, 48]
    assert list(prefill.get_ydata()) == [r["prefill_tok_s"] for r in data["sweep"]]
    assert list(decode.get_ydata()) == [r["decode_tok_s"] for r in data["sweep"]]


def test_bench_plot_without_lengths_takes_those_that_fit(ckpts, tmp_path, capsys):
    import entity

    out = tmp_path / "bench.png"
    code, stdout, err = _lucy(capsys, "bench", ckpts["a"], "--runs", 1, "--new-tokens", 8, "--json", "--plot", out)  # fmt: skip
    assert code == 0, err
    ctx = entity.load(ckpts["a"]).config.max_seq_len
    want = [n for n in (16, 64, 256, 1024) if n + 8 <= ctx]
    assert [r["prompt_tokens"] for r in json.loads(stdout)["sweep"]] == want and want
    _png(out, (800, 450))


def test_eval_plot_draws_kld_against_bits_per_weight(ckpts, tmp_path, capsys):
    from entity.convert import convert

    files = [tmp_path / "a.f32.entity", tmp_path / "a.q8.entity"]
    for f, quant in zip(files, ("f32", "q8"), strict=True):
        convert(ckpts["a"], f, quant=quant)
    out = tmp_path / "eval.png"
    code, stdout, err = _lucy(capsys, "eval", *files, "--reference", ckpts["a"], "--text", ckpts["text"],
                 "--ctx", N_CTX, "--json", "--plot", out)  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in stdout.splitlines()]
    assert [r["model"] for r in rows] == [str(f) for f in files]
    f32, q8 = rows
    assert f32["kld_mean"] < 1e-9 < q8["kld_mean"] and q8["bpw"] < f32["bpw"]
    pixels = _png(out, (800, 450))
    assert _has_color(pixels, plots.EVAL_COLOR) > 20  # the points

    (ax,) = plots.eval_figure(rows, str(ckpts["a"])).axes
    assert ax.get_xlabel().startswith("bits per weight") and ax.get_ylabel().startswith("mean KL")
    points = ax.lines[0]  # the markers (the error bars' caps follow)
    assert list(points.get_xdata()) == [f32["bpw"], q8["bpw"]]
    assert list(points.get_ydata()) == [f32["kld_mean"], q8["kld_mean"]]
    assert [t.get_text() for t in ax.texts] == ["a.f32.entity", "a.q8.entity"]


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


def test_docs_charts_are_drawn_from_the_results(tmp_path):
    from benchmarks import plot_docs

    assert plot_docs.main(["--out", str(tmp_path)]) == 0
    _png(tmp_path / "quantization_kld.png", (800, 450))
    data = json.loads(plot_docs.QUANT.read_text())
    points = plot_docs.quantization_points(data)
    names = {p["model"] for p in points}
    assert {"llama.cpp Q4_0", "llama.cpp Q4_K_M"} <= names
    assert all(p["kld_mean"] == data["llama_cpp_files_by_lucy_eval"][p["model"][10:]]["kld_mean"]
               for p in points if p["model"].startswith("llama.cpp "))  # fmt: skip
