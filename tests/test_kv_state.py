"""Saved KV state (Transformer.save_state / load_state, poly/model/state.py) on tiny random HF
checkpoints: N greedy tokens, save, a freshly loaded model restores the file and continues ->
transformers' greedy tokens of one uninterrupted run, on the fused C step, the reference path
(numpy backend) and a sliding-window model (its cache keeps the window only). The file is a
safetensors file the `safetensors` library reads; damaged, truncated, hostile and other-model
files are typed one-line errors that leave the model as it was."""

from __future__ import annotations

import errno
import json
import os
import struct
import tracemalloc

import numpy as np
import pytest

import entity
from poly.errors import (
    InsufficientSpaceError,
    ModelNotFoundError,
    OutputPathError,
    StateFileError,
    StateMismatchError,
)
from poly.runtime import fused, kernels
from poly.text.generation import generate_text
from poly.text.sampling import GenOptions
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint

PROMPT = [(7 * i + 3) % 290 + 5 for i in range(12)]
WINDOW = 16
LONG_PROMPT = [(5 * i + 1) % 290 + 5 for i in range(4 * WINDOW)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    over = {"sliding_window": WINDOW, "max_position_embeddings": 256}
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("mistral"), "mistral", seed=4, config_overrides=over
    )


@pytest.fixture(params=["c", "numpy"])
def backend(request, float_path):
    """The fused C step ("c") or the reference path ("numpy": no C call at all)."""
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend()


def _greedy(model, ids, n, history=None):
    opts = GenOptions(temperature=0.0, max_tokens=n)
    fresh = history is None
    return list(generate_text(model, ids, opts, start_fresh=fresh, history=history).tokens)


def _split_run(path, prompt, n1, n2, state_file, check=None):
    """n1 tokens, save, a new model loads the state and continues n2 -> all n1 + n2 tokens."""
    first = entity.load(path)
    a = _greedy(first, prompt, n1)
    cached = prompt + a[:-1]  # the cache holds all but the last generated token
    first.save_state(state_file, tokens=cached, meta={"note": "x"})
    if check is not None:
        check(first)
    second = entity.load(path)
    got = second.load_state(state_file)
    assert (got.position, got.tokens, got.meta) == (len(cached), cached, {"note": "x"})
    return a + _greedy(second, [a[-1]], n2, history=got.tokens), second


def test_restored_state_continues_as_transformers(llama, backend, tmp_path):
    tf = entity.load(llama)
    assert (fused.plan(tf) is not None) == (backend == "c")
    got, _ = _split_run(llama, PROMPT, 7, 9, tmp_path / "s.kv")
    assert got == hf_greedy(llama, PROMPT, 16)


def test_state_crosses_paths(llama, tmp_path, float_path):
    """Saved on the fused C step, continued on the reference path (numpy backend)."""
    first = entity.load(llama)
    assert fused.plan(first) is not None
    a = _greedy(first, PROMPT, 5)
    first.save_state(tmp_path / "x.kv", tokens=PROMPT + a[:-1])
    kernels.set_backend("numpy")
    try:
        second = entity.load(llama)
        st = second.load_state(tmp_path / "x.kv")
        b = _greedy(second, [a[-1]], 6, history=st.tokens)
    finally:
        kernels.set_backend()
    assert a + b == hf_greedy(llama, PROMPT, 11)


def test_windowed_state_continues_as_transformers(mistral, tmp_path):
    def check(model):  # the saved caches had dropped their oldest positions
        c = model.attn(0).state
        assert c.sliding and c.start > 0 and c.length - c.start <= c.k.shape[0]

    got, second = _split_run(mistral, LONG_PROMPT, 10, 14, tmp_path / "w.kv", check)
    assert got == hf_greedy(mistral, LONG_PROMPT, 24)
    assert second.attn(1).state.k.shape[0] < second.config.max_seq_len


def test_file_is_safetensors_and_small(llama, tmp_path):
    from safetensors.numpy import load_file

    tf = entity.load(llama)
    tf.forward(PROMPT)
    path = tmp_path / "s.kv"
    size = tf.save_state(path, tokens=PROMPT)
    assert size == path.stat().st_size
    arrays = load_file(str(path))
    assert arrays["tokens"].tolist() == PROMPT
    for i in range(tf.config.num_layers):
        c = tf.attn(i).state
        np.testing.assert_array_equal(arrays[f"k.{i}"], c.k[: len(PROMPT)])
        np.testing.assert_array_equal(arrays[f"v.{i}"], c.v[: len(PROMPT)])
    kv = sum(a.nbytes for k, a in arrays.items() if k != "tokens")
    assert size < kv + 4096  # the cached rows, not the reserved max_seq_len


def _saved(llama, tmp_path, name="s.kv"):
    tf = entity.load(llama)
    tf.forward(PROMPT)
    path = tmp_path / name
    tf.save_state(path, tokens=PROMPT)
    return tf, path


def _assert_untouched(model, path):
    before = model.position
    with pytest.raises(StateFileError) as err:
        model.load_state(path)
    assert model.position == before
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    return err.value


def test_damaged_files_are_typed_errors(llama, tmp_path):
    tf, path = _saved(llama, tmp_path)
    raw = path.read_bytes()
    fresh = entity.load(llama)
    fresh.forward(PROMPT[:3])  # a state in use: a failed load must leave it
    (n,) = struct.unpack("<Q", raw[:8])
    for cut in (0, 5, 8 + n // 2, 8 + n + 10, len(raw) - 1):
        (tmp_path / "cut.kv").write_bytes(raw[:cut])
        _assert_untouched(fresh, tmp_path / "cut.kv")
    flipped = bytearray(raw)
    flipped[8 + n + 100] ^= 0x40  # one bit of a key value
    (tmp_path / "flip.kv").write_bytes(bytes(flipped))
    assert "checksum" in str(_assert_untouched(fresh, tmp_path / "flip.kv"))
    (tmp_path / "tail.kv").write_bytes(raw + b"\0" * 16)
    _assert_untouched(fresh, tmp_path / "tail.kv")
    (tmp_path / "junk.kv").write_bytes(os.urandom(4096))
    _assert_untouched(fresh, tmp_path / "junk.kv")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    _assert_untouched(fresh, tmp_path / "obj.npy")  # never unpickled
    with pytest.raises(ModelNotFoundError):
        fresh.load_state(tmp_path / "absent.kv")
    assert _greedy(fresh, [5], 3, history=PROMPT[:3])  # the model still runs


def test_other_model_is_a_mismatch(llama, tmp_path):
    _, path = _saved(llama, tmp_path)
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=5)  # same shapes, weights differ
    with pytest.raises(StateMismatchError, match="weights"):
        entity.load(other).load_state(path)
    half = entity.load(llama)
    half.kv_cache_dtype = "f16"
    with pytest.raises(StateMismatchError, match="KV dtype"):
        half.load_state(path)
    with pytest.raises(StateMismatchError, match="context"):
        entity.load(llama, max_seq_len=8).load_state(path)  # 12 positions saved
    longer = entity.load(llama, max_seq_len=128)  # a longer context takes it
    assert longer.load_state(path).position == len(PROMPT)


def _rewrite_header(path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    state = json.loads(head["__metadata__"]["state"])
    edit(head, state)
    head["__metadata__"]["state"] = json.dumps(state)
    new = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_hostile_headers_allocate_nothing(llama, tmp_path):
    _, path = _saved(llama, tmp_path)
    model = entity.load(llama)
    big = 1 << 40

    def huge_rows(head, state):
        state["position"] = big
        for rec in state["layers"]:
            rec["length"] = big
        head["k.0"]["shape"][0] = big

    def huge_offsets(head, state):
        head["k.0"]["data_offsets"] = [0, big]

    def huge_start(head, state):
        state["layers"][0]["start"] = 5

    for edit in (huge_rows, huge_offsets, huge_start):
        bad = tmp_path / f"{edit.__name__}.kv"
        bad.write_bytes(path.read_bytes())
        _rewrite_header(bad, edit)
        tracemalloc.start()
        try:
            with pytest.raises(StateFileError):
                model.load_state(bad)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, edit.__name__
    (tmp_path / "size.kv").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(StateFileError, match="truncated"):
        model.load_state(tmp_path / "size.kv")


def test_write_is_atomic(llama, tmp_path, monkeypatch):
    tf, path = _saved(llama, tmp_path)
    old = path.read_bytes()
    tf.forward([7, 8])

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(InsufficientSpaceError):
        tf.save_state(path, tokens=PROMPT + [7, 8])
    monkeypatch.undo()
    assert path.read_bytes() == old  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.kv"]  # no temp left behind
    with pytest.raises(OutputPathError):
        tf.save_state(tmp_path / "no" / "dir.kv")
    with pytest.raises(StateFileError, match="tokens"):
        tf.save_state(tmp_path / "n.kv", tokens=PROMPT)  # 2 short of the cache
