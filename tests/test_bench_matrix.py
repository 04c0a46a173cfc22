"""benchmarks/matrix.py: argument parsing, roofline arithmetic, CPU parsing and the tables.
Nothing here times anything or starts an engine."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import matrix
from benchmarks.matrix import (
    DEFAULT_PRECISIONS,
    PRECISIONS,
    QUICK,
    engine_specs,
    parse_args,
    round_ops,
    rounds,
)
from benchmarks.matrix_report import (
    ceiling_tok_s,
    decode_bytes,
    parse_cpuinfo,
    ratio_table,
    render,
    roofline_fraction,
    speed_table,
    stats,
)
from benchmarks.workers import Engine


def test_defaults_cover_the_issue_matrix():
    a = parse_args([])
    assert a.runs == 5 and a.threads == 2 and a.new == 64 and a.agree_new == 64
    assert a.warmup == 1
    assert a.models == ["smollm2", "synth1b"]
    assert a.precisions == list(DEFAULT_PRECISIONS) == [
        "F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K",
    ]  # fmt: skip
    assert list(PRECISIONS)[: len(DEFAULT_PRECISIONS)] == a.precisions  # F32 first: the base
    assert a.prefill == [16, 42, 128, 512] and a.contexts == [0, 1000]


def test_llama_ftypes_match_llama_h():
    llama_cpp = pytest.importorskip("llama_cpp")

    for name, ftype in PRECISIONS.items():
        const = "LLAMA_FTYPE_ALL_F32" if name == "F32" else f"LLAMA_FTYPE_MOSTLY_{name}"
        assert getattr(llama_cpp, const) == ftype


def test_quick_overrides_and_f32_first():
    a = parse_args(["--quick", "--precisions", "Q4_0", "F32", "--runs", "9"])
    for key, value in QUICK.items():
        assert getattr(a, key) == value
    assert a.precisions == ["F32", "Q4_0"]  # F32 runs first: it is the agreement base


@pytest.mark.parametrize(
    "argv",
    [
        ["--runs", "0"],
        ["--warmup", "-1"],
        ["--prefill", "0"],
        ["--contexts", "-1"],
        ["--precisions", "Q9"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def test_engine_specs_per_cell(tmp_path):
    a = parse_args([])
    files = {"gguf": tmp_path / "m.gguf", "entity": tmp_path / "m-q4.entity"}
    specs = engine_specs("smollm2", "Q4_0", files, a)
    assert list(specs) == ["poly", "poly-entity-q4", "llama"]
    assert specs["llama"]["path"] == specs["poly"]["path"] == str(files["gguf"])
    assert specs["llama"]["n_ctx"] >= 512 + 1000 + 64
    assert specs["llama"]["buffers"] == "default"  # llama.cpp's own (repacked) buffers
    plain = engine_specs("smollm2", "Q4_0", files, parse_args(["--llama-buffers", "plain"]))
    assert plain["llama"]["buffers"] == "plain"
    f32 = engine_specs("smollm2", "F32", {"gguf": files["gguf"]}, a)
    assert list(f32) == ["poly", "llama", "hf"]
    assert "hf" not in engine_specs(
        "smollm2", "F32", {"gguf": files["gguf"]}, parse_args(["--no-hf"])
    )


def test_round_ops_lengths():
    a = parse_args(["--prefill", "3", "5", "--contexts", "0", "4", "--new", "7"])
    ops = round_ops(a, {"text": list(range(10))})
    assert [(k, n, len(r["ids"])) for k, n, r in ops] == [
        ("prefill", 3, 3), ("prefill", 5, 5), ("decode", 0, 1), ("decode", 4, 4),
    ]  # fmt: skip
    assert all(r["new"] == 7 for k, _, r in ops if k == "decode")


def test_decode_bytes_tied_and_untied():
    tied = [("token_embd.weight", 1000), ("blk.0.attn_q.weight", 200), ("output_norm.weight", 4)]
    assert decode_bytes(tied) == 1204  # the table is the LM head: read whole
    untied = tied + [("output.weight", 900)]
    assert decode_bytes(untied) == 1104  # one row of the table: not counted


def test_roofline_arithmetic():
    bw, per_token = 20e9, 540_000_000  # SmolLM2 f32: 540 MB per token
    assert ceiling_tok_s(per_token, bw) == pytest.approx(37.037, rel=1e-4)
    assert roofline_fraction(30.0, per_token, bw) == pytest.approx(0.81)
    assert roofline_fraction(ceiling_tok_s(per_token, bw), per_token, bw) == pytest.approx(1.0)


def test_parse_cpuinfo():
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_2 avx avx2 fma f16c "
        "avx512f avx512_vnni avx_vnni amx_tile bmi2\n\nprocessor\t: 1\nmodel name\t: other\n"
    )
    info = parse_cpuinfo(text)
    assert info["model"] == "AMD EPYC 9R14"
    assert info["flags"] == [
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile",
    ]  # fmt: skip
    assert parse_cpuinfo("") == {"model": "unknown", "flags": []}


def _entry(prefill: dict, decode: dict, **extra) -> dict:
    e = {
        "prefill": {str(k): stats([v]) for k, v in prefill.items()},
        "decode": {str(k): stats([v]) for k, v in decode.items()},
    }
    e.update(extra)
    return e


def _report() -> dict:
    args = vars(parse_args(["--prefill", "16", "--contexts", "0", "1000", "--models", "smollm2"]))
    poly = _entry({16: 300.0}, {0: 50.0, 1000: 40.0}, bytes_per_token=400_000_000, load_s=0.5)
    poly.update(rss_mb=700.0, agree=64)
    llama = _entry({16: 200.0}, {0: 40.0, 1000: 50.0}, bytes_per_token=400_000_000)
    cells = [
        {"model": "smollm2", "precision": "F32", "engines": {"poly": poly, "llama": llama}},
        {"model": "smollm2", "precision": "Q2_K", "engines": {"poly": {"error": "died"}}},
    ]
    machine = {
        "cpu": {"model": "Test CPU", "flags": ["avx2"]},
        "cpus": 2,
        "load": [1.0, 2.0, 3.0],
        "bandwidth": 25e9,
        "bandwidth_runs": [20e9, 25e9, 21e9],
    }
    return {"machine": machine, "args": args, "cells": cells}


def test_speed_table_rows_and_roofline():
    r = _report()
    lines = speed_table(r["cells"], r["args"], 25e9).splitlines()
    assert lines[0].startswith("| precision | engine | prefill 16 | decode @0 | decode @1000 |")
    assert lines[2] == "| F32 | poly | 300 | 50.0 | 40.0 | 0.80 | 0.50 | 700 | 64 |"
    assert lines[3] == "| F32 | llama | 200 | 40.0 | 50.0 | 0.64 | - | - | - |"
    assert lines[4] == "| Q2_K | poly | failed: died |"
    r["cells"][0]["engines"]["llama"]["buffers"] = "plain"  # fell back from the default
    lines = speed_table(r["cells"], r["args"], 25e9).splitlines()
    assert lines[3].startswith("| F32 | llama (plain) | 200 |")


def test_ratio_table():
    r = _report()
    lines = ratio_table(r["cells"], r["args"]).splitlines()
    assert lines[2] == "| F32 | poly / llama | 1.50x | 1.25x | 0.80x |"
    assert len(lines) == 3  # the failed cell has no ratio row


def test_render_has_header_and_both_tables():
    text = render(_report())
    assert "CPU: Test CPU (2 logical CPUs); flags: avx2" in text
    assert "read bandwidth 25.0 GB/s" in text and "the most of 3 measurements, 20.0-25.0" in text
    assert "## smollm2" in text and "Ratios (smollm2):" in text
    assert "llama.cpp weight buffers: default" in text
    old = _report()  # reports before session 25 name no buffers: they ran on plain ones
    del old["args"]["llama_buffers"]
    assert "llama.cpp weight buffers: plain" in render(old)
    r = _report()  # reports since session 23: the median of the measurements
    r["machine"].update(bandwidth=21e9, bandwidth_stat="median")
    assert "read bandwidth 21.0 GB/s" in render(r) and "the median of 3 measurements" in render(r)


def test_compare_engine_specs_from_the_shared_workers(tmp_path):
    from benchmarks.compare import ENGINES, WORK, engine_spec

    fields = {"threads": 2, "gguf": "m.gguf", "hf_dir": str(tmp_path), "llama_buffers": "default"}
    args = type("A", (), fields)()
    specs = {name: engine_spec(name, args) for name in ENGINES}
    assert specs["poly-f32"] == {
        "threads": 2, "kind": "poly", "path": "m.gguf", "keep_quantized": False,
    }  # fmt: skip
    assert specs["poly-gguf-q4_1"]["keep_quantized"] is True
    assert specs["poly-entity-q8"]["path"] == str(WORK / "smollm2-q8.entity")
    assert specs["llama-f16"]["path"] == str(WORK / "smollm2-f16.gguf")
    assert specs["llama-q4_1"]["path"] == "m.gguf"
    assert specs["llama-q4_1"]["buffers"] == specs["llama-f16"]["buffers"] == "default"
    assert specs["hf-f32"] == {"threads": 2, "kind": "hf", "path": str(tmp_path)}


class _Dying:
    """A Worker stand-in: a llama.cpp worker on default buffers dies in its warm-up."""

    started: list = []

    def __init__(self, name, spec):
        self.name, self.spec = name, spec
        _Dying.started.append(dict(spec))

    def ask(self, req):
        if self.spec.get("buffers") == "default":
            raise RuntimeError(f"worker {self.name} died (exit -11)")
        return {}


def test_start_worker_falls_back_to_plain_buffers_and_says_so(monkeypatch):
    import benchmarks.workers as workers

    monkeypatch.setattr(workers, "Worker", _Dying)
    _Dying.started = []
    spec = {"kind": "llama", "path": "m.gguf", "buffers": "default"}
    w = workers.start_worker("llama", spec, {"op": "decode"})
    assert [s["buffers"] for s in _Dying.started] == ["default", "plain"]
    assert w.spec["buffers"] == spec["buffers"] == "plain"
    with pytest.raises(RuntimeError):  # plain asked for, or a poly worker: no second try
        workers.start_worker("poly", {"kind": "poly", "buffers": "default"}, {"op": "decode"})
    assert len(_Dying.started) == 3


class FakeEngine(Engine):
    """Records what Engine asks of its primitives (no model, no timing)."""

    def __init__(self):
        self.calls, self.cache = [], []

    def reset(self):
        self.calls.append("reset")
        self.cache = []

    def truncate(self, n):
        self.calls.append(f"truncate {n}")
        self.cache = self.cache[:n]

    def forward(self, ids):
        self.calls.append(f"forward {len(ids)}")
        self.cache += list(ids)
        return np.eye(8)[sum(self.cache) % 8]


def test_decode_prefills_a_context_once_then_cuts_back_to_it():
    e = FakeEngine()
    first = e.decode([1, 2, 3], 2)[1]
    assert e.calls == ["reset", "forward 3", "forward 1", "forward 1"]
    e.calls.clear()
    assert e.decode([1, 2, 3], 2)[1] == first  # same context: cut back, last id fed again
    assert e.calls == ["truncate 2", "forward 1", "forward 1", "forward 1"]
    e.prefill([5])
    e.calls.clear()
    e.decode([1, 2, 3], 1)  # a prefill in between: the context is built again
    assert e.calls == ["reset", "forward 3", "forward 1"]


class _Timed:
    """A worker whose n-th answer takes n seconds: shows which runs the rounds keep."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def ask(self, req: dict) -> dict:
        self.calls += 1
        return {"prefill_s": float(self.calls), "decode_s": float(self.calls)}


def test_rounds_drop_the_warm_up_runs(monkeypatch):
    monkeypatch.setattr("benchmarks.matrix.SETTLE", 0.0)
    a = parse_args(["--runs", "3", "--warmup", "2", "--prefill", "16", "--contexts", "0"])
    ids = {"text": list(range(1, 40))}
    workers = [_Timed("poly"), _Timed("llama")]
    samples = rounds("[t]", workers, {}, a, ids)
    assert [w.calls for w in workers] == [10, 10]  # 2 ops x (2 warm-up + 3 timed)
    assert samples["poly"]["prefill"]["16"] == [16 / 3, 16 / 4, 16 / 5]  # calls 1-2 untimed
    assert samples["llama"]["decode"]["0"] == [a.new / 8, a.new / 9, a.new / 10]


@pytest.mark.parametrize("buffers,plain", [("default", 0), ("plain", 1)])
def test_gguf_cpu_runs_llama_on_its_default_buffers(monkeypatch, buffers, plain):
    """benchmarks/gguf_cpu.py: llama.cpp as its users run it unless plain buffers are asked for."""
    import sys
    import types

    import benchmarks.workers as workers
    from benchmarks import gguf_cpu

    asked = []
    monkeypatch.setattr(workers, "llama_plain_buffers", lambda: asked.append(1))
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=lambda **kw: kw))
    gguf_cpu._llama("m.gguf", [1, 2], 2, buffers)
    assert len(asked) == plain


def test_cell_files_write_no_f32_source_when_the_quantized_file_exists(tmp_path, monkeypatch):
    """An 8B-shaped cell whose Q4_K_M file is there runs without its 28.7 GB F32 source (which
    may have been deleted); the .entity copy is not made when --no-entity drops it."""
    monkeypatch.setattr(matrix, "WORK", tmp_path)

    def no_source(model):
        raise AssertionError(f"wrote the F32 source of {model}")

    monkeypatch.setattr(matrix, "source_f32", no_source)
    (tmp_path / "matrix").mkdir()
    for name in ("synth8b-Q4_K_M.gguf", "smollm2-Q8_0.gguf"):
        (tmp_path / "matrix" / name).write_bytes(b"GGUF")
    got = matrix.cell_files("synth8b", "Q4_K_M", 2)
    assert got == {"gguf": tmp_path / "matrix" / "synth8b-Q4_K_M.gguf"}
    got = matrix.cell_files("smollm2", "Q8_0", 2, entity_copy=False)
    assert got == {"gguf": tmp_path / "matrix" / "smollm2-Q8_0.gguf"}
    with pytest.raises(AssertionError, match="F32 source of smollm2"):
        matrix.cell_files("smollm2", "Q8_0", 2)  # its .entity copy is made from the source
