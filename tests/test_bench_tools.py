"""benchmarks/ab.py (A/B of two builds) and benchmarks/kinds.py (decode GB/s per stored type):
their arguments, that an A/B round imports the tree it names, and that `pure` quantization
leaves every matrix in the one type. Nothing here asserts a speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ab, kinds

REPO = Path(__file__).resolve().parents[1]


def test_ab_needs_two_checkouts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ab.parse_args(["m.gguf", "--a", str(REPO), "--b", str(tmp_path)])
    assert e.value.code == 2 and "not a poly checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse_args(["m.gguf", "--b", str(REPO), "--rounds", "0"])
    a = ab.parse_args(["m.gguf", "--b", str(REPO)])
    assert (a.a, a.rounds, a.reps, a.prefill, a.new, a.kv_cache) == (".", 6, 2, [16, 42], 64, "f16")


def test_ab_rounds_alternate_and_time_every_op(smollm2_gguf, tmp_path, monkeypatch, capsys):
    trees = []
    real = ab.one_round

    def spy(tree, a):
        trees.append(tree)
        return real(tree, a)

    monkeypatch.setattr(ab, "one_round", spy)
    out = tmp_path / "ab.json"
    argv = [str(smollm2_gguf), "--a", str(REPO), "--b", str(REPO), "--rounds", "2", "--reps", "1"]
    argv += ["--prefill", "4", "--new", "2", "--context", "3", "--json", str(out)]
    assert ab.main(argv) == 0
    assert trees == [str(REPO)] * 4  # A B, then B A
    assert "| B/A by round |" in capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    for side in ("A", "B"):
        assert set(runs[side]) == {"prefill 4", "decode 2 @3"}
        assert all(len(v) == 2 and min(v) > 0 for v in runs[side].values())


def test_ab_paired_ratio_is_the_median_of_each_rounds_own():
    # three rounds of two runs: B/A 1.05, 1.05 and 0.9 in turn, whatever speed the round ran at
    a, b = [100, 100, 200, 200, 100, 100], [105, 105, 210, 210, 90, 90]
    assert ab.paired(a, b, 2) == pytest.approx(1.05)
    assert ab.paired(a[:2], b[:2], 2) == pytest.approx(1.05)


def test_ab_round_fails_on_a_tree_without_the_benchmarks(tmp_path):
    (tmp_path / "poly").mkdir()
    (tmp_path / "poly" / "__init__.py").write_text("")
    a = ab.parse_args(["m.gguf", "--b", str(tmp_path), "--prefill", "4", "--new", "0"])
    with pytest.raises(SystemExit, match="the round failed"):
        ab.one_round(str(tmp_path), a)


def test_kinds_arguments(capsys):
    a = kinds.parse_args([])
    assert a.types == list(kinds.DEFAULT_TYPES) and a.engines == ["poly", "llama"]
    assert (a.hidden, a.ffn, a.layers, a.rounds) == (2048, 8192, 4, 5)
    with pytest.raises(SystemExit):
        kinds.parse_args(["--hidden", "1000"])  # not a multiple of 256: no K-quant blocks
    assert set(kinds.DEFAULT_TYPES) <= set(kinds.TYPES)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_pure_quantization_puts_every_matrix_in_one_type(kind, smollm2_gguf, tmp_path):
    pytest.importorskip("llama_cpp")
    from gguf import GGMLQuantizationType, GGUFReader

    from benchmarks.matrix import quantize
    from benchmarks.synthetic_gguf import write

    src = write(
        tmp_path / "f32.gguf", smollm2_gguf, hidden=256, layers=2, ffn=512, heads=4, kv_heads=2
    )
    quantize(src, tmp_path / "pure.gguf", kinds.TYPES[kind], 2, pure=True)
    quantize(src, tmp_path / "mixed.gguf", kinds.TYPES[kind], 2)
    want = GGMLQuantizationType[kind]
    pure = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "pure.gguf").tensors}
    mixed = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "mixed.gguf").tensors}
    matrices = [n for n in pure if not n.endswith("norm.weight")]
    assert len(matrices) == 1 + 2 * 7
    assert all(pure[n] == want for n in matrices)
    assert any(mixed[n] != want for n in matrices)  # the preset mixes types: pure is not it


def test_prefill_paths_times_each_path(smollm2_gguf, tmp_path, monkeypatch):
    """benchmarks.prefill_paths runs each prompt as fused calls and on the reference path (the
    dispatcher's choice overridden, then put back) and writes both paths' tok/s."""
    from benchmarks import prefill_paths
    from poly.runtime import dispatch, fused

    real, calls = dispatch.fused_prompt, []
    calls_real = fused.prefill_calls
    monkeypatch.setattr(fused, "prefill_calls", lambda *a: calls.append(1) or calls_real(*a))
    out = tmp_path / "paths.json"
    prefill_paths.main([str(smollm2_gguf), "--lengths", "70", "--rounds", "2", "--json", str(out)])
    got = json.loads(out.read_text())
    assert set(got["tok_s"]["70"]) == {"fused", "reference"}
    assert all(len(v) == 2 for v in got["seconds"]["70"].values())
    assert len(calls) == 2, "the fused path ran once a round, the reference path never"
    assert dispatch.fused_prompt is real
