"""`lucy eval` and poly.text.evaluate (issue 59, Measure): perplexity and KL divergence against
numbers computed independently from transformers' logits on tiny random checkpoints, against
llama.cpp's perplexity on a GGUF its own converter wrote, and the CLI's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import entity
from poly.errors import ModelNotFoundError, UsageError
from poly.text.evaluate import evaluate, reference_logits, window_starts
from tests.hf_fixtures import hf_logits, make_tiny_checkpoint

N_CTX = 32
TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "It was the best of times, it was the worst of times, it was the age of wisdom. "
) * 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    return {
        "a": make_tiny_checkpoint(base / "a", "llama", seed=5),
        "b": make_tiny_checkpoint(base / "b", "llama", seed=6),
        "wide": make_tiny_checkpoint(
            base / "wide", "llama", seed=5, config_overrides={"vocab_size": 320}
        ),  # fmt: skip
        "text": _write(base / "text.txt", TEXT),
        "empty": _write(base / "empty.txt", " \n\n"),
    }


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _ids(model) -> list[int]:
    ids = model.tokenizer.encode(TEXT)
    assert len(ids) >= 3 * N_CTX
    return ids


def _torch_windows(model_dir, ids):
    """Per window: transformers' float64 log-probabilities of the scored positions (n_ctx/2 ..
    n_ctx-2) and the ids they predict."""
    import torch

    first = N_CTX // 2
    for start in window_starts(len(ids), N_CTX):
        window = ids[start : start + N_CTX]
        logits = torch.from_numpy(hf_logits(model_dir, window)).double()
        yield torch.log_softmax(logits[first:-1], dim=-1), torch.tensor(window[first + 1 :])


def test_kld_of_a_model_against_itself_is_zero(ckpts):
    a, again = entity.load(ckpts["a"]), entity.load(ckpts["a"])
    res = evaluate(a, _ids(a), reference=again, n_ctx=N_CTX)
    assert res.windows == len(_ids(a)) // N_CTX and res.tokens == res.windows * (N_CTX // 2 - 1)
    assert res.kld_mean == pytest.approx(0.0, abs=1e-9)
    assert res.kld_max == pytest.approx(0.0, abs=1e-9)
    assert res.top1 == 1.0 and res.ppl == pytest.approx(res.ref_ppl, rel=1e-9)


def test_perplexity_and_kld_equal_transformers(ckpts):
    """ppl = exp(mean NLL) and KL(b || a) from transformers' logits of both checkpoints."""
    import torch

    a, b = entity.load(ckpts["a"]), entity.load(ckpts["b"])
    ids = _ids(a)
    nll, kld, same = [], [], []
    for (logp_a, tgt), (logp_b, _) in zip(_torch_windows(ckpts["a"], ids),
                                          _torch_windows(ckpts["b"], ids)):  # fmt: skip
        nll.append(-logp_a[torch.arange(tgt.numel()), tgt])
        kld.append((logp_b.exp() * (logp_b - logp_a)).sum(-1))
        same.append(logp_a.argmax(-1) == logp_b.argmax(-1))
    nll, kld = torch.cat(nll), torch.cat(kld)
    res = evaluate(a, ids, reference=b, n_ctx=N_CTX)
    assert res.ppl == pytest.approx(float(torch.exp(nll.mean())), rel=1e-4)
    assert res.kld_mean == pytest.approx(float(kld.mean()), rel=1e-3)
    assert res.kld_max == pytest.approx(float(kld.max()), rel=1e-3)
    assert res.kld_median == pytest.approx(float(kld.median()), rel=1e-2)
    assert res.top1 == pytest.approx(float(torch.cat(same).double().mean()), abs=0.02)
    assert res.kld_mean > 0.01  # two different random models: the test can fail
    # a kept reference (its logits, window by window) measures the same
    kept = list(reference_logits(b, ids, N_CTX))
    again = evaluate(a, ids, reference=kept, n_ctx=N_CTX)
    assert again.kld_mean == pytest.approx(res.kld_mean, rel=1e-9)


def test_bits_per_weight_counts_the_whole_file(ckpts, tmp_path):
    import transformers

    model = entity.load(ckpts["a"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["a"])
    params = sum(p.numel() for p in hf.parameters())
    size = (ckpts["a"] / "model.safetensors").stat().st_size
    res = evaluate(model, _ids(model), n_ctx=N_CTX, file_bytes=size)
    assert res.bpw == pytest.approx(size * 8 / params, rel=1e-12)
    assert res.kld_mean is None  # no reference: perplexity only


# --- the CLI ------------------------------------------------------------------------------------


def _lucy(*args, input=""):
    return subprocess.run([sys.executable, "-m", "lucy", "eval", *map(str, args)],
                          capture_output=True, text=True, timeout=240, input=input)  # fmt: skip


def _one_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lucy: error: "), proc.stderr
    return lines[0]


def test_cli_measures_and_prints_json(ckpts):
    proc = _lucy(ckpts["a"], "--reference", ckpts["b"], "--text", "-", "--ctx", N_CTX, "--json",
                 input=TEXT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    a, b = entity.load(ckpts["a"]), entity.load(ckpts["b"])
    want = evaluate(a, _ids(a), reference=b, n_ctx=N_CTX)
    assert data["kld_mean"] == pytest.approx(want.kld_mean, rel=1e-6)
    assert data["complete"] and data["windows"] == data["windows_total"] == want.windows
    assert data["bpw"] > 31  # float32 safetensors: 32 bits a weight plus the header


@pytest.mark.parametrize(
    "which, code, needle",
    [
        ("missing-model", ModelNotFoundError.exit_code, "no-such"),
        ("missing-text", ModelNotFoundError.exit_code, "text file"),
        ("empty-text", UsageError.exit_code, "empty"),
        ("vocab", UsageError.exit_code, "different vocabularies (320 and 300"),
        ("ctx-over", UsageError.exit_code, "over the model's context (256)"),
        ("short-text", UsageError.exit_code, "needs at least 32"),
    ],
)
def test_cli_bad_inputs_are_one_line_errors(ckpts, tmp_path, which, code, needle):
    model, ref, text, ctx = ckpts["wide"] if which == "vocab" else ckpts["a"], ckpts["a"], \
        ckpts["text"], N_CTX  # fmt: skip
    if which == "missing-model":
        model = tmp_path / "no-such.gguf"
    elif which == "missing-text":
        text = tmp_path / "no-such.txt"
    elif which == "empty-text":
        text = ckpts["empty"]
    elif which == "ctx-over":
        ctx = 4096
    elif which == "short-text":
        text = _write(tmp_path / "short.txt", "A stitch in time saves nine.")
    proc = _lucy(model, "--reference", ref, "--text", text, "--ctx", ctx)
    assert proc.returncode == code, proc.stderr
    assert needle in _one_line(proc)
    assert proc.stdout == ""


def test_ctrl_c_prints_the_windows_measured_then_exits_130(ckpts, monkeypatch, capsys):
    """An interrupt after the first window: its numbers are printed, then 'interrupted', 130."""
    import lucy.evaluate as cli_eval
    from lucy.cli import run

    real = cli_eval.evaluate

    def interrupted(*args, progress=None, **kw):
        def stop(done, total, detail):
            raise KeyboardInterrupt

        return real(*args, progress=stop, **kw)

    monkeypatch.setattr(cli_eval, "evaluate", interrupted)
    code = run(["eval", str(ckpts["a"]), "--reference", str(ckpts["b"]), "--text",
                str(ckpts["text"]), "--ctx", str(N_CTX), "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 130 and err.strip() == "lucy: error: interrupted"
    data = json.loads(out)
    assert data["windows"] == 1 < data["windows_total"] and data["complete"] is False
    assert data["tokens"] == N_CTX // 2 - 1 and data["kld_mean"] > 0


# --- llama.cpp's perplexity ---------------------------------------------------------------------


@pytest.mark.slow
def test_perplexity_of_a_gguf_equals_llama_cpps(ckpts, tmp_path):
    """Acceptance 4 on a tiny GGUF written by llama.cpp's converter: poly's perplexity of the
    file equals llama.cpp's (llama-cpp-python's logits, the same windows) within 1 %."""
    pytest.importorskip("llama_cpp")
    from benchmarks import llama_convert, llama_eval

    root = llama_convert.converter_dir()
    if root is None:
        pytest.skip("llama.cpp converter (llama-cpp-python sdist) not available")
    gguf = llama_convert.convert(ckpts["b"], tmp_path / "b.gguf", "f32", root)
    model = entity.load(gguf)
    ids = _ids(model)
    ours = evaluate(model, ids, n_ctx=N_CTX).ppl
    theirs = llama_eval.perplexity(gguf, ids, N_CTX, bos=None)
    assert ours == pytest.approx(theirs, rel=0.01)
    assert ours == pytest.approx(evaluate(entity.load(ckpts["b"]), ids, n_ctx=N_CTX).ppl, rel=1e-3)
    np.testing.assert_array_equal(model.tokenizer.encode(TEXT), ids)
