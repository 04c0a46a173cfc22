"""The per-CPU tune file (poly/runtime/tune_cache.py) and the prompt path measured at first use
(poly/runtime/crossover.py) that overrides dispatch's shipped rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from poly.runtime import ckernels, crossover, dispatch, fused, threadtune, tune_cache
from tests.tiny_model import random_transformer, tiny_cfg

AVX2_CPU = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
stepping\t: 1
flags\t\t: fpu sse4_2 avx f16c fma avx2 bmi2 hypervisor
processor\t: 1
model name\t: AMD EPYC 7B13
"""
AVX512_CPU = AVX2_CPU.replace("avx2 bmi2", "avx2 bmi2 avx512f avx512bw avx512_vnni")


@pytest.fixture
def tune_home(tmp_path, monkeypatch):
    """Tuning on, against an empty POLY_HOME, with this process's decisions forgotten."""
    monkeypatch.setenv("POLY_HOME", str(tmp_path))
    monkeypatch.setenv("POLY_TUNE", "1")
    monkeypatch.setattr(crossover, "_SEEN", {})
    monkeypatch.setattr(crossover, "_LOADED", {"until": 0.0})
    monkeypatch.setattr(threadtune, "room_for", lambda threads: True)  # a quiet machine
    return tmp_path


def test_the_store_round_trips_through_its_file(tmp_path):
    path = tmp_path / "tune" / "cpu.json"
    tune_cache.TuneStore(path, {"model": "x"}).put("a", {"fused": True, "fused_s": 0.25})
    tune_cache.TuneStore(path).put("b", [1, 2])  # a second writer keeps the first's entry
    again = tune_cache.TuneStore(path)
    assert again.get("a") == {"fused": True, "fused_s": 0.25} and again.get("b") == [1, 2]
    doc = json.loads(path.read_text())
    assert doc["version"] == tune_cache.VERSION and set(doc["entries"]) == {"a", "b"}
    assert [p.name for p in path.parent.iterdir()] == ["cpu.json"]  # no temporary file left


@pytest.mark.parametrize(
    "text",
    ["{not json", '{"version": 1, "entries": ', '{"version": 99, "entries": {"a": 1}}', "[]"],
)
def test_a_corrupt_or_foreign_file_is_ignored_and_replaced(tmp_path, text):
    path = tmp_path / "cpu.json"
    path.write_text(text)
    store = tune_cache.TuneStore(path)
    assert store.get("a") is None
    assert store.put("a", 2)
    assert json.loads(path.read_text())["entries"] == {"a": 2}


def test_an_unwritable_folder_keeps_the_finding_in_memory(tmp_path):
    (tmp_path / "tune").write_text("a file where the folder should be")
    store = tune_cache.TuneStore(tmp_path / "tune" / "cpu.json")
    assert store.put("a", 1) is False
    assert store.get("a") == 1


def test_the_cpu_key_follows_the_flags_build_and_cores_only():
    avx2, avx512 = tune_cache.cpu_facts(AVX2_CPU), tune_cache.cpu_facts(AVX512_CPU)
    assert avx2["model"] == "AMD EPYC 7B13" and avx2["family"] == "25" and avx2["cpu_model"] == "1"
    assert "hypervisor" not in avx2["flags"] and "avx2" in avx2["flags"]
    key = tune_cache.cpu_key(avx2, "avx2", 2)
    assert key.startswith("amd-epyc-7b13-f25m1-avx2-2c-")
    assert tune_cache.cpu_key(avx512, "avx2", 2) != key
    assert tune_cache.cpu_key(avx2, "base", 2) != key
    assert tune_cache.cpu_key(avx2, "avx2", 16) != key
    other_flag = tune_cache.cpu_facts(AVX2_CPU.replace("hypervisor", "hypervisor rdrand"))
    assert tune_cache.cpu_key(other_flag, "avx2", 2) == key  # not a kernel flag


def _model(hidden: int, layers: int = 2):
    cfg = tiny_cfg(
        hidden=hidden, inter=256, num_layers=layers, num_heads=hidden // 64,
        num_kv_heads=max(1, hidden // 256), max_seq_len=1024,
    )  # fmt: skip
    return random_transformer(cfg, seed=4)


needs_simd = pytest.mark.skipif(
    not (ckernels.AVAILABLE and ckernels.SIMD), reason="fused calls need the SIMD build"
)


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_poly_tune_0_keeps_the_shipped_rule(tune_home, monkeypatch):
    monkeypatch.setenv("POLY_TUNE", "0")
    monkeypatch.setattr(crossover, "measure", lambda *a: pytest.fail("measured with POLY_TUNE=0"))
    wide = _model(1280, layers=1)
    assert dispatch.calls_win(wide, fused.plan(wide), 65) is False  # float32 past SMALL_WIDTH
    assert not (tune_home / "tune").exists()


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_a_measured_decision_overrides_the_shipped_rule_and_is_kept(tune_home, monkeypatch):
    seen = []

    def fused_faster(model, p, n):
        seen.append(n)
        return 0.010, 0.020  # fused calls twice as fast

    monkeypatch.setattr(crossover, "measure", fused_faster)
    wide = _model(1280, layers=1)
    p = fused.plan(wide)
    assert dispatch.shipped_rule(wide, p, 65) is False
    assert dispatch.calls_win(wide, p, 65) is True and seen == [128]  # probed at its class
    assert dispatch.calls_win(wide, p, 100) is True and seen == [128]  # same class: no probe
    [file] = (tune_home / "tune").iterdir()
    entries = json.loads(file.read_text())["entries"]
    assert list(entries.values()) == [
        {"fused": True, "fused_s": 0.010, "reference_s": 0.020, "default": False}
    ]
    monkeypatch.setattr(crossover, "_SEEN", {})  # a new process: the file decides, no probe
    monkeypatch.setattr(tune_cache, "_STORES", {})
    assert dispatch.calls_win(wide, p, 65) is True and seen == [128]
    monkeypatch.setenv("POLY_TUNE", "force")  # measured again, and the file follows
    monkeypatch.setattr(crossover, "_SEEN", {})
    monkeypatch.setattr(crossover, "measure", lambda model, p, n: (0.030, 0.020))
    assert dispatch.calls_win(wide, p, 65) is False
    assert list(json.loads(file.read_text())["entries"].values())[0]["fused"] is False


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_a_measured_loss_sends_a_prompt_to_the_reference_path(tune_home, monkeypatch):
    narrow = _model(64)
    monkeypatch.setattr(crossover, "measure", lambda model, p, n: (0.020, 0.010))
    calls = []
    monkeypatch.setattr(fused, "prefill_calls", lambda *a: calls.append(1))
    narrow.reset()
    narrow.forward(list(range(1, 41)))  # 40 tokens: one fused call by the shipped rule
    assert calls == []
    monkeypatch.setattr(crossover, "measure", lambda model, p, n: (0.0100, 0.0102))  # a tie
    narrow.forward(list(range(1, 81)))  # 80 tokens: another class; a tie keeps the rule
    assert calls == [1]


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_a_failed_probe_keeps_the_shipped_rule_for_the_process(tune_home, monkeypatch):
    def out_of_memory(model, p, n):
        raise MemoryError

    monkeypatch.setattr(crossover, "measure", out_of_memory)
    narrow = _model(64)
    p = fused.plan(narrow)
    assert dispatch.calls_win(narrow, p, 200) is True  # the shipped rule at 64 wide
    monkeypatch.setattr(crossover, "measure", lambda *a: pytest.fail("probed again"))
    assert dispatch.calls_win(narrow, p, 250) is True
    assert not (tune_home / "tune").exists()


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_no_probe_on_a_loaded_machine(tune_home, monkeypatch):
    looks = []
    monkeypatch.setattr(threadtune, "room_for", lambda threads: looks.append(1) or False)
    monkeypatch.setattr(crossover, "measure", lambda *a: pytest.fail("measured under load"))
    narrow = _model(64)
    p = fused.plan(narrow)
    assert dispatch.calls_win(narrow, p, 200) is True and looks == [1]
    assert dispatch.calls_win(narrow, p, 200) is True and looks == [1]  # no look per prompt
    assert not (tune_home / "tune").exists()
    monkeypatch.setattr(crossover, "_LOADED", {"until": 0.0})  # LOADED_RETRY later, quiet
    monkeypatch.setattr(threadtune, "room_for", lambda threads: True)
    monkeypatch.setattr(crossover, "measure", lambda model, p, n: (0.030, 0.010))
    assert dispatch.calls_win(narrow, p, 200) is False


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_the_table_probes_every_class_and_keeps_it(tune_home):
    tf = _model(64, layers=3)
    rows = crossover.table(tf, dispatch.shipped_rule, lengths=(16, 100))
    assert [r["tokens"] for r in rows] == [16, 128]
    assert all(r["fused_s"] > 0 and r["reference_s"] > 0 and r["default"] for r in rows)
    [file] = (tune_home / "tune").iterdir()
    assert len(json.loads(file.read_text())["entries"]) == 2


@needs_simd
@pytest.mark.usefixtures("c_backend")
def test_the_probe_times_both_paths_and_leaves_the_caches_alone(tune_home):
    tf = _model(64, layers=6)
    ids = list(range(3, 23))
    tf.reset()
    tf.forward(ids)
    want = tf.forward([7])  # the next token's logits after the prompt
    tf.reset()
    tf.forward(ids)
    got = crossover.measure(tf, fused.plan(tf), 128)
    assert got is not None and all(0 < t < 5 for t in got)
    assert tf.position == len(ids)
    np.testing.assert_array_equal(tf.forward([7]), want)
    assert crossover.probe_blocks(fused.plan(tf), 128) == crossover.MAX_BLOCKS + 1  # + the cut one
