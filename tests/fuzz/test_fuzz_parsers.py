"""Hypothesis fuzzing of the GGUF, safetensors(-header) and .entity parsers (issue 8, acceptance 2).

Properties: (1) random bytes, (2) valid files with random edits (byte flips, splices, truncation,
length-field overwrites) only ever raise ``PolyError``; (3) round trips of every format against
an independent writer (the reference ``safetensors`` and ``gguf`` packages, numpy arrays).
Budget and modes: see tests/fuzz/harness.py.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.fuzz.corpus import (
    byte_vocab,
    entity_valid,
    gguf_model,
    gguf_valid,
    st_valid,
)
from tests.fuzz.harness import FUZZ, FUZZ_SLOW, run_target

pytestmark = pytest.mark.timeout(600)

SEEDS = {
    "safetensors": st_valid({"format": "pt"}),
    "gguf": gguf_valid(),
    "gguf_model": gguf_model(tokens=byte_vocab()[:40] + ["<|im_start|>", "<|im_end|>"], hidden=8),
    "entity": entity_valid(),
}
SEEDS["load"] = SEEDS["gguf_model"]

# --- (1) random bytes ---------------------------------------------------------------------------

MAGICS = [b"", b"GGUF", b"ENTITY\x00\x00", b"\x80\x04", b"PK\x03\x04"]


@FUZZ
@given(prefix=st.sampled_from(MAGICS), body=st.binary(max_size=512))
@pytest.mark.parametrize("target", ["safetensors", "safetensors_header", "gguf", "entity", "load"])
def test_random_bytes_raise_only_our_errors(target, prefix, body):
    run_target(target, prefix + body)


@FUZZ
@given(
    version=st.sampled_from([2, 3]),
    n_tensors=st.integers(0, 2**64 - 1),
    n_kv=st.integers(0, 2**64 - 1),
    body=st.binary(max_size=256),
)
def test_gguf_random_counts(version, n_tensors, n_kv, body):
    run_target("gguf", b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body)


@FUZZ
@given(n=st.integers(0, 2**64 - 1), header=st.text(max_size=200), tail=st.binary(max_size=64))
def test_safetensors_random_header_length_and_text(n, header, tail):
    raw = header.encode("utf-8", "surrogatepass")
    run_target("safetensors", struct.pack("<Q", n) + raw + tail)
    run_target("safetensors", struct.pack("<Q", len(raw)) + raw + tail)


# --- (2) random edits of valid files ----------------------------------------------------------------


@st.composite
def edited(draw, seed: bytes, tail: bool = False) -> bytes:
    """``seed`` with 1-4 random edits; ``tail`` may confine them to the last third (the data)."""
    data = bytearray(seed)
    low = len(data) * 2 // 3 if tail and draw(st.booleans()) else 0
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "byte", "u64", "u32", "cut", "insert", "delete"]))
        at = draw(st.integers(min(low, max(len(data) - 1, 0)), max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind in ("u64", "u32"):
            size = 8 if kind == "u64" else 4
            value = draw(
                st.sampled_from([0, 1, 2 ** (8 * size) - 1, 2 ** (8 * size - 1), 65540, 7])
            )
            data[at : at + size] = value.to_bytes(size, "little")
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize("target", ["safetensors", "gguf", "gguf_model", "entity", "load"])
def test_edited_valid_files_raise_only_our_errors(target, data):
    run_target(target, data.draw(edited(SEEDS[target])))


def test_seeds_are_valid():
    for target, seed in SEEDS.items():
        assert run_target(target, seed) is None, target


def test_truncation_sweep():
    # every prefix of the small seeds, 300 sampled prefixes of the model-sized ones
    rng = np.random.default_rng(0)
    for target, seed in SEEDS.items():
        cuts = range(len(seed)) if len(seed) <= 1024 else rng.choice(len(seed), 300, replace=False)
        for n in cuts:
            assert run_target(target, seed[: int(n)]) is not None, (target, n)


# --- (3) round trips ---------------------------------------------------------------------------------

ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "I32": np.int32,
             "I64": np.int64, "F64": np.float64, "I16": np.int16}  # fmt: skip
names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@st.composite
def arrays(draw, dtypes):
    dtype = draw(st.sampled_from(dtypes))
    return draw(hnp.arrays(dtype, draw(shapes)))


@FUZZ
@given(tensors=st.dictionaries(names.filter(lambda s: s != "__metadata__"),
                               arrays([np.dtype(d) for d in ST_DTYPES.values()]), max_size=5),
       meta=st.dictionaries(names, st.text(max_size=10), max_size=3))  # fmt: skip
def test_safetensors_roundtrip_against_reference_writer(tensors, meta, tmp_path_factory):
    from safetensors.numpy import save

    from entity.hf.safetensors_io import SafetensorsFile

    p = tmp_path_factory.getbasetemp() / "rt.safetensors"
    p.write_bytes(save(tensors, metadata=meta or None))
    f = SafetensorsFile(p)
    assert set(f.names()) == set(tensors)
    assert f.metadata == meta
    for name, arr in tensors.items():
        got = f.tensor(name)
        assert got.shape == arr.shape and got.dtype == arr.dtype
        assert got.tobytes() == arr.tobytes()


GGUF_VALUES = {
    "u8": (st.integers(0, 255), "add_uint8"),
    "i32": (st.integers(-(2**31), 2**31 - 1), "add_int32"),
    "u64": (st.integers(0, 2**64 - 1), "add_uint64"),
    "f32": (st.floats(width=32, allow_nan=False), "add_float32"),
    "bool": (st.booleans(), "add_bool"),
    "str": (st.text(min_size=1, max_size=30), "add_string"),  # the writer drops ""
    "arr": (st.lists(st.integers(-1000, 1000), min_size=1, max_size=10), "add_array"),
}
keys = st.from_regex(r"[a-z][a-z0-9_]{0,8}(\.[a-z][a-z0-9_]{0,8}){0,2}", fullmatch=True)


@FUZZ_SLOW
@given(
    kvs=st.dictionaries(keys.filter(lambda k: not k.startswith("general.")), st.sampled_from(sorted(GGUF_VALUES)), max_size=6).flatmap(
        lambda d: st.fixed_dictionaries({k: st.tuples(st.just(t), GGUF_VALUES[t][0]) for k, t in d.items()})
    ),
    tensors=st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.]{0,20}", fullmatch=True),
                            arrays([np.dtype(np.float32), np.dtype(np.float16)]).filter(lambda a: a.ndim >= 1 and a.size > 0),
                            max_size=4),
)  # fmt: skip
def test_gguf_roundtrip_against_gguf_writer(kvs, tensors, tmp_path_factory):
    import gguf

    from entity.gguf.reader import GGUFFile

    p = tmp_path_factory.getbasetemp() / "rt.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for key, (kind, value) in kvs.items():
        getattr(w, GGUF_VALUES[kind][1])(key, value)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gg = GGUFFile(p)
    for key, (kind, value) in kvs.items():
        got = gg.metadata[key]
        if kind == "arr":
            assert [int(x) for x in got] == value
        elif kind == "f32":
            assert np.float32(got) == np.float32(value)
        else:
            assert got == value
    assert set(gg.tensors) == set(tensors)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(gg.tensor_array(name), arr)


@FUZZ
@given(blobs=st.dictionaries(names, arrays([np.dtype(d) for d in
                             ("f4", "f2", "i1", "u1", "i8", "f8", "u2", "i4")]), max_size=5),
       gen=st.dictionaries(names, st.integers() | st.text(max_size=5) | st.booleans(), max_size=3))  # fmt: skip
def test_entity_roundtrip(blobs, gen, tmp_path_factory):
    from entity.dotentity.container import EntityFile
    from tests.fuzz.corpus import ENTITY_META, entity_write

    p = tmp_path_factory.getbasetemp() / "rt.entity"
    p.unlink(missing_ok=True)
    meta = dict(ENTITY_META, generation_config=gen)
    assume(all(abs(v) < 2**63 for v in gen.values() if isinstance(v, int)))
    entity_write(p, blobs, meta)
    ef = EntityFile(p)
    assert set(ef.blobs) == set(blobs) and ef.meta("generation_config") == gen
    for name, arr in blobs.items():
        got = ef.array(name)
        assert got.shape == arr.shape and got.dtype == arr.dtype and got.tobytes() == arr.tobytes()


@FUZZ
@given(data=st.data())
def test_config_json_random_fields(data, tmp_path_factory):
    """config.json with random JSON values in the fields we read: ConfigError family only."""
    from entity.hf.config import load_hf_config
    from poly.errors import PolyError
    from tests.test_reliability_config import BASE

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
        max_leaves=8,
    )  # fmt: skip
    cfg = dict(BASE)
    for key in data.draw(st.lists(st.sampled_from(sorted(BASE)), max_size=3, unique=True)):
        cfg[key] = data.draw(json_values)
    d = tmp_path_factory.getbasetemp() / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    try:
        load_hf_config(d)
    except PolyError:
        pass


# --- (5) sampler properties -------------------------------------------------------------------------

logits_st = hnp.arrays(np.float32, st.integers(2, 64), elements=st.floats(-50, 50, width=32))


@FUZZ
@given(logits=logits_st, temperature=st.floats(0.05, 3.0), top_k=st.integers(0, 70),
       top_p=st.floats(0.01, 1.0), min_p=st.floats(0.0, 0.99), seed=st.integers(0, 2**32))  # fmt: skip
def test_sampler_properties(logits, temperature, top_k, top_p, min_p, seed):
    from poly.text.sampling import GenOptions, Sampler

    v = logits.shape[0]
    greedy = Sampler(GenOptions(temperature=0.0), v)
    assert greedy.sample(logits) == int(np.argmax(logits))
    s = Sampler(
        GenOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed), v
    )
    p = s.probabilities(logits)
    assert np.isfinite(p).all() and abs(p.sum() - 1.0) < 1e-9 and (p >= 0).all()
    if top_k:  # support within the top-k (ties at the k-th value may all stay)
        kth = np.sort(logits)[::-1][min(top_k, v) - 1]
        assert np.count_nonzero(p) <= np.count_nonzero(logits >= kth)
    tok = s.sample(logits)
    assert 0 <= tok < v and p[tok] > 0


# --- (4) differential: never accept what the reference reader refuses ---------------------------------


@FUZZ
@given(data=st.data())
def test_safetensors_differential_against_reference(data):
    """Edited files we accept are accepted by the reference with identical tensors (we are the
    stricter parser: duplicates, unknown fields; reliability.md §(c) differential tests)."""
    from safetensors.numpy import load as ref_load

    from entity.hf.safetensors_io import SafetensorsFile
    from tests.fuzz.harness import scratch_file

    raw = data.draw(edited(SEEDS["safetensors"], tail=True))
    if run_target("safetensors", raw) is not None:
        return
    ours = SafetensorsFile(scratch_file("x.safetensors", raw))
    ref = ref_load(raw)
    assert set(ref) == set(ours.names())
    for name, arr in ref.items():
        assert ours.tensor(name).tobytes() == arr.tobytes()


@FUZZ
@given(data=st.data())
def test_gguf_differential_against_gguf_py(data):
    """Edited GGUF files we accept parse in gguf-py with the same tensors and raw bytes."""
    from gguf import GGUFReader

    from entity.gguf.reader import GGUFFile
    from tests.fuzz.harness import scratch_file

    raw = data.draw(edited(SEEDS["gguf"], tail=True))
    if run_target("gguf", raw) is not None:
        return
    p = scratch_file("d.gguf", raw)
    ours, ref = GGUFFile(p), GGUFReader(str(p))
    assert {t.name for t in ref.tensors} == set(ours.tensors)
    for t in ref.tensors:
        assert bytes(ours.tensor_bytes(t.name).reshape(-1)) == bytes(
            t.data.view(np.uint8).reshape(-1)
        )
