"""Reading Loom v1 `.entity` files, built here by an independent writer that follows
loom_inventory §4 (JSON header at byte 20, payload-relative offsets, §4.4 native encodings,
§4.6 Q4_0 payload, §1.9 four-layer stride)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from entity.dotentity.v1 import read_entity_v1
from poly.errors import EntityFormatError

D, HEADS, KV, HD, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 96, 40, 2
Q, KVD = HEADS * HD, KV * HD


def _loom_round(x: np.ndarray) -> np.ndarray:
    """Go math.Round: half away from zero (inventory appendix A)."""
    t = np.trunc(x)
    return t + np.sign(x) * (np.abs(x - t) >= 0.5)


def _q4_blob(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Loom Q4_0 bake of a flat float32 array: the blob bytes and the values they decode to."""
    flat = w.astype(np.float32).ravel()
    nb = -(-flat.size // 32)
    blocks = np.zeros(nb * 32, np.float32)
    blocks[: flat.size] = flat
    blocks = blocks.reshape(nb, 32)
    scale = (np.abs(blocks).max(axis=1) / np.float32(7)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(_loom_round((blocks / safe[:, None]).astype(np.float64)), -8, 7).astype(
        np.int64
    )
    codes[scale == 0] = 0
    u = (codes & 0xF).astype(np.uint8)
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)  # [nb, 16], even element low
    n_words = max(512, -(-(4 * nb) // 64) * 64)
    words = np.zeros(n_words * 4, np.uint8)
    words[: nb * 16] = packed.ravel()
    blob = struct.pack("<II", nb, n_words) + scale.astype("<f4").tobytes() + words.tobytes()
    values = (codes.astype(np.float32) * scale[:, None]).ravel()[: flat.size]
    return blob, values.reshape(w.shape)


class V1Writer:
    def __init__(self):
        self.payload = bytearray()
        self.blobs: list[dict] = []

    def add(self, path: str, data: bytes, dtype: str, native: bool, scale: float | None = None):
        rec = {"path": path, "offset": len(self.payload), "length": len(data), "dtype": dtype}
        if scale is not None:
            rec["scale"] = scale
        rec["native"] = native
        self.blobs.append(rec)
        self.payload += data

    def write(self, path, transformer: dict, version: int = 1) -> None:
        layers = [
            {"type": t}
            for _ in range(LAYERS)
            for t in ("RMSNorm", "MultiHeadAttention", "RMSNorm", "SwiGLU")
        ]
        net = {
            "id": "network",
            "depth": 1,
            "rows": 1,
            "cols": 1,
            "layers_per_cell": 4 * LAYERS,
            "layers": layers,
        }
        header = {
            "format_version": version,
            "network": net,
            "transformer": transformer,
            "blobs": self.blobs,
        }
        hj = json.dumps(header, separators=(",", ":")).encode()
        with open(path, "wb") as f:
            f.write(b"ENTITY\0\0" + struct.pack("<HHQ", version, 0, len(hj)) + hj + self.payload)


def _spec(weight_dtype: str, tied: bool) -> dict:
    dims = {"num_layers": LAYERS, "num_heads": HEADS, "num_kv_heads": KV, "head_dim": HD, "query_dim": Q,
            "kv_dim": KVD, "intermediate_size": INTER, "rms_norm_eps": 1e-5, "rope_freq_base": 50000.0,
            "activation": "Silu"}  # fmt: skip
    spec = {
        "architecture": "llama_style_decoder",
        "hidden_size": D,
        "vocab_size": VOCAB,
        "has_final_norm": True,
    }
    if tied:
        spec["lm_head_tied"] = True
    spec["weight_dtype"] = weight_dtype
    spec["dims"] = dims
    return spec


def _random_block(rng) -> dict[str, dict[str, np.ndarray]]:
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "attn_norm": {"gamma": f(D)},
        "attn": {"w_q": f(Q, D), "w_k": f(KVD, D), "w_v": f(KVD, D), "w_o": f(D, Q),
                 "b_q": f(Q), "b_k": f(KVD), "b_v": f(KVD), "b_o": f(D),
                 "q_norm": f(HD), "k_norm": f(HD)},
        "mlp_norm": {"gamma": f(D)},
        "mlp": {"w_gate": f(INTER, D), "w_up": f(INTER, D), "w_down": f(D, INTER),
                "b_gate": f(INTER), "b_up": f(INTER), "b_down": f(D)},
    }  # fmt: skip


MASTER_ORDER = {
    "attn_norm": ["gamma"], "mlp_norm": ["gamma"],
    "attn": ["w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"],
    "mlp": ["w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"],
}  # fmt: skip
ROLES = ["attn_norm", "attn", "mlp_norm", "mlp"]


def _build(tmp_path, lane: str, tied: bool = False, seed: int = 0):
    """Write a v1 file of one lane ('f32', 'f16', 'q4'); return (path, expected blocks, globals)."""
    rng = np.random.default_rng(seed)
    blocks = [_random_block(rng) for _ in range(LAYERS)]
    emb = rng.standard_normal((VOCAB, D)).astype(np.float32)
    head = None if tied else rng.standard_normal((VOCAB, D)).astype(np.float32)
    final = rng.standard_normal(D).astype(np.float32)
    w = V1Writer()
    expected = []
    for b, blk in enumerate(blocks):
        exp = {}
        for k, role in enumerate(ROLES):
            i = 4 * b + k
            comps = blk[role]
            master = np.concatenate([comps[n].ravel() for n in MASTER_ORDER[role]])
            exp[role] = {n: comps[n] for n in MASTER_ORDER[role]}
            if lane == "f32" or role.endswith("norm"):
                w.add(f"layers.{i}", master.astype("<f4").tobytes(), "float32", True)
            elif lane == "f16":
                half = master.astype(np.float16)
                w.add(f"layers.{i}", half.tobytes(), "float16", True)
                exp[role] = {
                    n: v.astype(np.float16).astype(np.float32) for n, v in exp[role].items()
                }
            else:  # q4 bake: weights as Q4_0, MHA biases dropped, SwiGLU bias tail as float32
                keys = {
                    "w_q": 200,
                    "w_k": 201,
                    "w_v": 202,
                    "w_o": 203,
                    "w_gate": 100,
                    "w_up": 101,
                    "w_down": 102,
                }
                for name in MASTER_ORDER[role]:
                    if name in keys:
                        blob, vals = _q4_blob(comps[name])
                        w.add(f"layers.{i}.q4_0.{keys[name]}", blob, "Q4_0", True)
                        exp[role][name] = vals
                    elif role == "attn":
                        exp[role][name] = np.zeros_like(comps[name])
                if role == "mlp":
                    tail = np.concatenate([comps[n] for n in ("b_gate", "b_up", "b_down")])
                    w.add(f"layers.{i}.biases", tail.astype("<f4").tobytes(), "float32", False)
            if role == "attn" and lane == "q4":
                for norm in ("q_norm", "k_norm"):
                    w.add(
                        f"layers.{i}.{norm}", comps[norm].astype("<f4").tobytes(), "float32", False
                    )
                    exp[role][norm] = comps[norm]
        expected.append(exp)
    # Loom writes globals last (standard lane); raw float32, not native.
    w.add("transformer.embeddings", emb.tobytes(), "float32", False)
    if head is not None:
        w.add("transformer.lm_head", head.tobytes(), "float32", False)
    w.add("transformer.final_norm", final.tobytes(), "float32", False)
    path = tmp_path / f"{lane}.entity"
    w.write(path, _spec({"f32": "float32", "f16": "float16", "q4": "int4"}[lane], tied))
    return path, expected, (emb, head, final)


@pytest.mark.parametrize("lane, tied", [("f32", False), ("f16", True), ("q4", False), ("q4", True)])
def test_v1_lanes_decode_to_what_was_written(tmp_path, lane, tied):
    path, expected, (emb, head, final) = _build(tmp_path, lane, tied)
    ck = read_entity_v1(path)
    cfg = ck.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (D, HEADS, KV, HD)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_layers) == (INTER, VOCAB, LAYERS)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 50000.0
    assert cfg.tie_word_embeddings == tied and cfg.qk_norm == (lane == "q4")
    for got, exp in zip(ck.blocks, expected):
        for role in ROLES:
            assert set(got[role]) == set(exp[role])
            for name, value in exp[role].items():
                np.testing.assert_array_equal(got[role][name], value, err_msg=f"{role}.{name}")
    np.testing.assert_array_equal(ck.embeddings, emb)
    np.testing.assert_array_equal(ck.final_norm, final)
    if tied:
        assert ck.lm_head is None
    else:
        np.testing.assert_array_equal(ck.lm_head, head)


def test_q4_error_is_bounded_by_half_a_step(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 40)).astype(np.float32)  # 280 values: a partial last block
    blob, _ = _q4_blob(w)
    from entity.dotentity.v1 import q4_0_decode

    got = q4_0_decode(blob, w.size).reshape(w.shape)
    flat = np.zeros(9 * 32, np.float32)
    flat[: w.size] = w.ravel()
    step = np.repeat(np.abs(flat.reshape(9, 32)).max(axis=1) / 7, 32)[: w.size].reshape(w.shape)
    assert np.all(np.abs(got - w) <= step / 2 + 1e-6)


def test_v1_transformer_loads(tmp_path):
    pytest.importorskip("poly.model.transformer")
    from entity.dotentity.v1 import load_entity_v1
    from poly.nn import layout

    path, expected, (emb, head, final) = _build(tmp_path, "q4", tied=False)
    tf = load_entity_v1(path, max_seq_len=64)
    for b, exp in enumerate(expected):
        views = layout.mha(tf.attn(b)).as_dict()
        for name, value in exp["attn"].items():
            np.testing.assert_array_equal(views[name], value)
        mlp = layout.swiglu(tf.mlp(b)).as_dict()
        for name, value in exp["mlp"].items():
            np.testing.assert_array_equal(mlp[name], value)
    np.testing.assert_array_equal(np.asarray(tf.embeddings), emb)
    logits = tf.forward([1, 2, 3])
    assert logits.shape == (VOCAB,) and np.all(np.isfinite(logits))


def _corrupt(tmp_path, edit):
    path, _, _ = _build(tmp_path, "f32")
    data = path.read_bytes()
    hlen = struct.unpack("<Q", data[12:20])[0]
    header = json.loads(data[20 : 20 + hlen])
    payload = data[20 + hlen :]
    res = edit(header, payload)
    if isinstance(res, tuple):
        header, payload = res
    hj = json.dumps(header).encode() if isinstance(header, dict) else header
    out = tmp_path / "bad.entity"
    out.write_bytes(data[:12] + struct.pack("<Q", len(hj)) + hj + payload)
    return out


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h, p: h["blobs"][0].update(offset=len(p)), "past the end"),
        (lambda h, p: h["blobs"][1].update(offset=0), "overlap"),
        (lambda h, p: h["blobs"].pop(), "missing"),
        (lambda h, p: h["blobs"][0].update(length=8), "bytes"),
        (lambda h, p: h["transformer"]["dims"].update(num_heads=5), "dims"),
        (lambda h, p: h["blobs"].append(dict(h["blobs"][0])), "duplicate"),
        (lambda h, p: (b'{"format_version":1,"a":1,"a":2}', p), "duplicate"),
        (lambda h, p: (b"[" * 100000, p), "JSON"),
        (lambda h, p: (b'{"format_version":1,"x":NaN}', p), "JSON"),
        (lambda h, p: h.pop("transformer"), "transformer"),
    ],
)
def test_v1_bad_inputs_are_typed(tmp_path, edit, match):
    out = _corrupt(tmp_path, edit)
    with pytest.raises(EntityFormatError, match=match):
        read_entity_v1(out)


def test_v1_truncations_are_typed(tmp_path):
    path, _, _ = _build(tmp_path, "q4")
    data = path.read_bytes()
    out = tmp_path / "cut.entity"
    rng = np.random.default_rng(0)
    for n in sorted(set(rng.integers(0, len(data), 60).tolist()) | {0, 19, 20, len(data) - 1}):
        out.write_bytes(data[:n])
        with pytest.raises(EntityFormatError):
            read_entity_v1(out)
