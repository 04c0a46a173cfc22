"""GGUF blocks kept native in q4/q8 `.entity` files (entity.dotentity.native_blocks), on tiny synthetic
GGUF models: bitwise blocks, forward equal to the GGUF direct path, typed errors on damage."""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

import entity.dotentity.container as entity_format
from entity.convert import convert
from entity.dotentity.container import EntityFile, EntityWriter
from entity.dotentity.native_blocks import NATIVE_TYPES
from entity.dotentity.read import load_entity
from entity.dotentity.write import save_entity
from entity.gguf.loader import load_gguf
from poly.errors import EntityFormatError, IntegrityError
from poly.nn import layout
from poly.quant.qtensor import GGUFMatrix
from poly.runtime import ckernels
from tests.fuzz.corpus import U32, byte_vocab, gguf_model_parts, gguf_pack

H = FF = 256  # K-quants need rows of whole 256-blocks
IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 115, 107]
# one kind per matrix, all kept native (kinds without a C kernel, e.g. TQ2_0, are baked)
KINDS = {
    "attn_q": T.Q4_0,
    "attn_k": T.Q4_1,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_K,
    "ffn_gate": T.Q6_K,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q8_0,
    "token_embd": T.Q8_0,
    "output": T.Q4_0,
}


def _k_blocks(rng, shape, qtype) -> bytes:
    """Random K-quant rows with small finite fp16 scales (gguf-py cannot quantize K kinds)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
    scales = np.float16(rng.uniform(0.002, 0.02, raw.shape[0]))[:, None].view(np.uint8)
    if qtype == T.Q4_K:  # d, dmin lead the block
        raw[:, 0:2], raw[:, 2:4] = scales, scales
    else:  # Q6_K: d ends the block
        raw[:, -2:] = scales
    return raw.tobytes()


def _tensor(rng, name: str, shape, kinds) -> tuple:
    suffix = name.split(".")[-2]
    qtype = kinds.get(suffix, T.F32) if len(shape) == 2 else T.F32
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if qtype == T.F32:
        raw = w.tobytes()
    elif qtype in (T.Q4_K, T.Q6_K):
        raw = _k_blocks(rng, shape, qtype)
    else:
        raw = quants.quantize(w, qtype).tobytes()
    return name, int(qtype), list(reversed(shape)), raw


def write_tiny_gguf(path: Path, *, tied: bool = True, kinds=KINDS, layers: int = 2) -> Path:
    """A tiny llama (byte vocab, hidden 256) whose matrices are stored in ``kinds``."""
    kvs, f32 = gguf_model_parts(seed=1, tokens=byte_vocab(), hidden=H, layers=layers)
    kvs = [(k, U32, FF) if k == "llama.feed_forward_length" else (k, t, v) for k, t, v in kvs]
    shapes = {name: tuple(reversed(dims)) for name, _, dims, _ in f32}
    for i in range(layers):
        for part in ("gate", "up"):
            shapes[f"blk.{i}.ffn_{part}.weight"] = (FF, H)
        shapes[f"blk.{i}.ffn_down.weight"] = (H, FF)
    if not tied:
        shapes["output.weight"] = shapes["token_embd.weight"]
    rng = np.random.default_rng(7)
    path.write_bytes(gguf_pack(kvs, [_tensor(rng, n, s, kinds) for n, s in shapes.items()]))
    return path


def _matrices(tf) -> dict[str, object]:
    out = {"embeddings": tf.embeddings}
    if not tf.tied:
        out["lm_head"] = tf.lm_head
    for i in range(tf.config.num_layers):
        for role in ("attn", "mlp"):
            for name, value in layout.components(getattr(tf, role)(i)).items():
                if name.startswith("w_"):
                    out[f"blocks.{i}.{role}.{name}"] = value
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{tied: (gguf path, q4 .entity path)}"""
    base = tmp_path_factory.mktemp("native")
    out = {}
    for tied in (True, False):
        src = write_tiny_gguf(base / f"m-{tied}.gguf", tied=tied)
        dst = base / f"m-{tied}.entity"
        report = convert(src, dst, quant="q4", verify=True)
        assert report.verified
        out[tied] = (src, dst, report)
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_blocks_are_the_gguf_bytes(tiny, tied):
    src, dst, report = tiny[tied]
    ref = load_gguf(src, keep_quantized=True)
    got = load_entity(dst)
    ef = EntityFile(dst)
    assert ef.meta("quant")["native"] == ["gguf_q4_0", "gguf_q4_1", "gguf_q4_k", "gguf_q6_k", "gguf_q8_0"]  # fmt: skip
    for name, r in _matrices(ref).items():
        g = _matrices(got)[name]
        assert isinstance(r, GGUFMatrix) and isinstance(g, GGUFMatrix), name
        assert g.ggml_type == r.ggml_type and g.shape == r.shape
        np.testing.assert_array_equal(g.raw, r.raw)  # q/k rows un-permuted in both
        rec = ef.blobs[name]
        assert rec.ggml_type == int(r.ggml_type) and rec.dtype == "uint8"
        assert rec.shape == list(r.raw.shape) and not g.raw.flags.writeable  # the mapping
        assert np.shares_memory(g.raw, got.entity_file.array(name))  # no copy
    assert report.exact  # --verify: bitwise blocks, exact vectors
    assert got.attn(0).weights.active == "gguf_q4_0+gguf_q4_1+gguf_q4_k+gguf_q8_0"
    assert got.source["native_blocks"] == ef.meta("quant")["native"]


@pytest.mark.parametrize("tied", [True, False])
def test_forward_equals_the_gguf_direct_path(tiny, tied):
    src, dst, _ = tiny[tied]
    ref, got = load_gguf(src, keep_quantized=True), load_entity(dst)
    # 20 tokens: the prefill path (dequantize + BLAS); then one-token decode steps (C kernels)
    np.testing.assert_allclose(got.forward_all(IDS), ref.forward_all(IDS), rtol=0, atol=1e-6)
    ref.reset(), got.reset()
    a, b = ref.forward(IDS[:3]), got.forward(IDS[:3])
    for _ in range(8):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
        nxt = [int(np.argmax(a))]
        a, b = ref.forward(nxt), got.forward(nxt)


def test_q8_keeps_q8_blocks_only_and_float_schemes_dequantize(tiny, tmp_path):
    src = tiny[True][0]
    report = convert(src, tmp_path / "q8.entity", quant="q8")
    ef = EntityFile(tmp_path / "q8.entity")
    assert ef.blobs["blocks.1.mlp.w_down"].ggml_type == int(T.Q8_0)  # as precise as asked: kept
    for name in ("blocks.1.mlp.w_gate", "blocks.1.attn.w_q", "blocks.1.attn.w_k"):  # Q6_K, Q4_*
        assert name not in ef.blobs and ef.blobs[f"{name}.codes"].dtype == "int8"
    assert ef.meta("quant")["native"] == ["gguf_q8_0"]
    assert report.notes == [
        "precision cannot exceed the source: the q8 file holds the values of its Q4_0, Q4_1, "
        "Q4_K, Q6_K blocks, re-encoded as q8"
    ]
    for quant in ("f16", "f32"):
        out = tmp_path / f"{quant}.entity"
        report = convert(src, out, quant=quant, verify=True)
        ef = EntityFile(out)
        assert all(r.ggml_type is None for r in ef.blobs.values())
        assert "native" not in ef.meta("quant")
        assert report.exact == (quant == "f32")
    # embed_quant overrides the embeddings only
    convert(src, tmp_path / "e16.entity", quant="q4", embed_quant="f16")
    ef = EntityFile(tmp_path / "e16.entity")
    assert ef.blobs["embeddings"].dtype == "float16"
    assert ef.blobs["blocks.0.attn.w_q"].ggml_type == int(T.Q4_0)


def test_float_and_unsupported_kinds_keep_the_loom_bake(tiny, tmp_path):
    """F32 matrices and kinds without a C kernel (TQ2_0) are baked to Loom Q4_0 as before."""
    src = write_tiny_gguf(
        tmp_path / "mixed.gguf", kinds={**KINDS, "ffn_up": T.TQ2_0, "attn_v": T.F32}
    )
    out = tmp_path / "mixed.entity"
    convert(src, out, quant="q4", verify=True)
    ef = EntityFile(out)
    for name in ("blocks.0.mlp.w_up", "blocks.0.attn.w_v"):
        assert name not in ef.blobs and ef.blobs[f"{name}.packed"].ggml_type is None
    tf = load_entity(out)
    assert tf.mlp(0).weights.active == "gguf_q6_k+gguf_q8_0+loom_q4"
    assert np.isfinite(tf.forward_all(IDS[:5])).all()


def test_every_kind_with_a_c_kernel_is_kept(tmp_path):
    """Q5_0 / Q5_1 blocks (C kernels since round 2) stay native in a q4 .entity, like Q4_K."""
    src = write_tiny_gguf(tmp_path / "q5.gguf", kinds={**KINDS, "ffn_up": T.Q5_0, "attn_k": T.Q5_1})
    out = tmp_path / "q5.entity"
    convert(src, out, quant="q4", verify=True)
    ef = EntityFile(out)
    assert ef.blobs["blocks.0.mlp.w_up"].ggml_type == int(T.Q5_0)
    assert ef.blobs["blocks.0.attn.w_k"].ggml_type == int(T.Q5_1)
    assert np.isfinite(load_entity(out).forward_all(IDS[:5])).all()


def test_entity_and_save_paths_keep_the_blocks(tiny, tmp_path):
    src, dst, _ = tiny[False]
    again = tmp_path / "again.entity"
    assert convert(dst, again, quant="q4", verify=True).exact  # .entity -> .entity
    saved = save_entity(load_gguf(src), tmp_path / "saved.entity", quant="q4")
    ref = EntityFile(dst)
    for path in (again, saved):
        ef = EntityFile(path)
        assert ef.meta("quant") == ref.meta("quant")
        for name, rec in ref.blobs.items():
            assert ef.blobs[name].ggml_type == rec.ggml_type
            np.testing.assert_array_equal(ef.array(name), ref.array(name))


def test_float_sources_write_no_native_records(tmp_path):
    """Files without kept blocks carry no `ggml_type`/`native` keys: older v2 readers read them."""
    from tests.fuzz.corpus import tiny_model

    tf = tiny_model(tmp_path)
    path = save_entity(tf, tmp_path / "f.entity", quant="q4")
    data = Path(path).read_bytes()
    hlen = int.from_bytes(data[12:20], "little")
    assert b"ggml_type" not in data[20 : 20 + hlen] and b"native" not in data[20 : 20 + hlen]


def test_native_kinds_are_the_c_kernel_kinds():
    """Every GGUF block kind a C kernel reads (the float GGUF types are not blocks)."""
    from poly.quant import schemes

    blocks = [n for n in ckernels.GGUF_KINDS if schemes.get(n).block > 1]
    assert sorted(NATIVE_TYPES.values()) == sorted(blocks)
    assert {"gguf_q5_0", "gguf_iq4_xs", "gguf_q2_k"} <= set(blocks)


# --- malformed native records ------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, monkeypatch, **changes) -> Path:
    """Copy ``src`` blob by blob; ``changes[name](array, ggml_type) -> (array, ggml_type)``. The
    writer's own record check is switched off so that it writes what a reader must refuse."""
    ef = EntityFile(src)
    meta = {k: ef.meta(k) for k in entity_format.META_KEYS}
    with monkeypatch.context() as m:
        m.setattr(entity_format, "check_record", lambda *a: None)
        w = EntityWriter(dst)
        for rec in sorted(ef.blobs.values(), key=lambda r: r.offset):
            arr, gt = ef.array(rec.path), rec.ggml_type
            if rec.path in changes:
                arr, gt = changes[rec.path](arr, gt)
            w.add(rec.path, arr, ggml_type=gt)
        return w.finish(meta)


WQ = "blocks.0.attn.w_q"  # Q4_0, [256, 256] -> uint8 [256, 144]
SHORT = "size_mismatch"
CASES = {  # case -> (changes, the error's reason tag)
    "unknown type id": ({WQ: lambda a, t: (a, 99)}, "quant_type"),
    "kind without a C kernel (TQ2_0)": ({WQ: lambda a, t: (a, int(T.TQ2_0))}, "quant_type"),
    "blocks of another size (Q8_0)": ({WQ: lambda a, t: (a, int(T.Q8_0))}, SHORT),
    "rows of another kind (Q4_1)": ({WQ: lambda a, t: (a[:, :140], int(T.Q4_1))}, SHORT),
    "rows one block short": ({WQ: lambda a, t: (a[:, :-18], t)}, SHORT),
    "rows one block long": ({WQ: lambda a, t: (np.concatenate([a, a[:, :18]], 1), t)}, SHORT),
    "one row missing": ({WQ: lambda a, t: (a[:-1], t)}, SHORT),
    "flat blob": ({WQ: lambda a, t: (a.reshape(-1), t)}, SHORT),
    "type id on a float32 vector": ({"final_norm": lambda a, t: (a, int(T.Q4_0))}, SHORT),
    "type id on int8 bytes": ({WQ: lambda a, t: (a.view(np.int8), t)}, SHORT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_native_records_are_format_errors(tiny, tmp_path, monkeypatch, case):
    changes, reason = CASES[case]
    bad = _rewrite(tiny[True][1], tmp_path / "bad.entity", monkeypatch, **changes)
    for verify in (True, False):
        with pytest.raises(EntityFormatError, match=reason):
            load_entity(bad, verify=verify)


def test_damaged_native_blobs(tiny, tmp_path):
    data = tiny[True][1].read_bytes()
    rec = EntityFile(tiny[True][1]).blobs[WQ]
    flipped = bytearray(data)
    flipped[rec.offset + rec.length // 2] ^= 0x10
    bad = tmp_path / "flip.entity"
    bad.write_bytes(bytes(flipped))
    for verify in (True, "lazy"):
        with pytest.raises(IntegrityError):
            load_entity(bad, verify=verify)
    for cut in (rec.offset + 7, rec.offset + rec.length - 1, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(EntityFormatError):
            load_entity(bad)


def test_writer_refuses_bad_native_blobs(tmp_path):
    w = EntityWriter(tmp_path / "w.entity")
    try:
        with pytest.raises(EntityFormatError):
            w.add("a", np.zeros((2, 18), np.uint8), ggml_type=99)
        with pytest.raises(EntityFormatError):
            w.add("b", np.zeros((2, 18), np.float32), ggml_type=int(T.Q4_0))
        with pytest.raises(EntityFormatError):
            w.add("c", np.zeros((2, 19), np.uint8), ggml_type=int(T.Q4_0))
        w.add("d", np.zeros((2, 18), np.uint8), ggml_type=int(T.Q4_0))
    finally:
        w.close()


def test_header_records_the_type(tiny):
    data = tiny[True][1].read_bytes()
    hlen = int.from_bytes(data[12:20], "little")
    header = msgpack.unpackb(data[20 : 20 + hlen], raw=False)
    rec = next(r for r in header["blobs"] if r["path"] == WQ)
    assert rec["ggml_type"] == int(T.Q4_0) and rec["shape"] == [256, 144]
    assert rec["length"] == 256 * 144


def test_verify_refuses_changed_blocks(tiny, tmp_path, monkeypatch):
    conv = sys.modules["entity.convert"]  # `entity.convert` the attribute is the function
    real = conv.load_entity

    def damaged(path, **kw):
        tf = real(path, **kw)
        m = tf.embeddings
        raw = np.array(m.raw)
        raw[3, 5] ^= 1
        tf.embeddings = GGUFMatrix(raw, m.ggml_type, m.shape)
        return tf

    monkeypatch.setattr(conv, "load_entity", damaged)
    out = tmp_path / "m.entity"
    with pytest.raises(IntegrityError, match="embeddings"):
        convert(tiny[True][0], out, quant="q4", verify=True)
    assert not out.exists()


def test_q8_from_a_q4_1_source_is_a_real_q8_file(tmp_path):
    """#13: `--quant q8` from Q4_1 blocks wrote the Q4_1 blocks (q4 size) and verified 0 error."""
    q41 = {k: T.Q4_1 for k in KINDS}
    src = write_tiny_gguf(tmp_path / "q41.gguf", kinds=q41)
    q4 = convert(src, tmp_path / "q4.entity", quant="q4", verify=True)
    q8 = convert(src, tmp_path / "q8.entity", quant="q8", verify=True)
    assert q4.notes == [] and q4.exact  # q4 keeps the Q4_1 blocks bit for bit
    assert q8.notes == [
        "precision cannot exceed the source: the q8 file holds the values of its Q4_1 blocks, "
        "re-encoded as q8"
    ]
    ef = EntityFile(tmp_path / "q8.entity")
    assert ef.meta("quant")["scheme"] == "q8" and "native" not in ef.meta("quant")
    assert all(rec.ggml_type is None for rec in ef.blobs.values())
    codes = [n for n in ef.blobs if n.endswith(".codes")]
    assert len(codes) == 7 * 2 + 1  # every matrix of both blocks + the tied embeddings
    assert q8.bytes > 1.4 * q4.bytes  # 8-bit codes, not the 4.5-bit blocks again
    # --verify measures the int8 rounding of the Q4_1 values: small, not a false 0
    assert 0 < q8.max_rel_rms < 0.01
    ref, got = load_gguf(src, keep_quantized=True), load_entity(tmp_path / "q8.entity")
    want = ref.attn(0).weights.versions["gguf"]["w_q"].dequantize()
    have = got.attn(0).weights.versions[got.attn(0).weights.active]["w_q"]
    assert have.scheme == "int8"
    np.testing.assert_allclose(
        have.dequantize(), want, rtol=0, atol=float(np.abs(want).max()) / 127
    )
