"""Reader for Loom's `.entity` version 1 (loom_inventory §4): JSON header, unaligned blobs.

v1 files come from Loom's HF converter: a flat grid of 4 layers per decoder block
[RMSNorm, MHA, RMSNorm, SwiGLU] (§1.9), blobs `layers.<i>` (a whole Loom master, native or raw
float32), or the Q4 bake `layers.<i>.q4_0.<key>` + `layers.<i>.biases`, plus `.q_norm`/`.k_norm`
aux blobs and globals `transformer.embeddings|lm_head|final_norm`. Everything is decoded to float32
(v1 is a compatibility path; re-save as v2 for 4-bit inference). MHA biases missing from Q4 files
stay zero, as in Loom.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from entity.arch import ROLES, global_shapes, role_shapes  # ROLES: the 4-layer stride of §1.9
from entity.dotentity.header import PREFIX, fail, read_prefix
from poly.config import TransformerConfig
from poly.dtypes import parse_dtype
from poly.errors import DTypeError, EntityFormatError, LayerConfigError, LimitExceededError
from poly.quant.loom_v1 import loom_decode
from poly.text.gendefaults import GenerationDefaults

__all__ = ["V1Checkpoint", "read_entity_v1", "load_entity_v1", "q4_0_decode"]

MAX_HEADER_LEN = 64 << 20  # Loom allowed 256 MiB (§4.1); real v1 headers are < 1 MiB
# Upper bound on the values of a JSON header, counted on the bytes before parsing ('[', '{' and
# ',' outside strings are all of them; inside strings they only over-count): 96 MB of `[],`
# was 2.6 GB of Python lists. Real v1 headers hold a few thousand values.
MAX_V1_ITEMS = 1 << 20
Q4_KEYS = {
    200: "w_q",
    201: "w_k",
    202: "w_v",
    203: "w_o",
    100: "w_gate",
    101: "w_up",
    102: "w_down",
}
Q4_BLOCK = 32


@dataclass
class V1Checkpoint:
    """A decoded v1 file: config, per-block float32 components and the globals."""

    config: TransformerConfig
    blocks: list[dict[str, dict[str, np.ndarray]]]
    embeddings: np.ndarray
    lm_head: np.ndarray | None
    final_norm: np.ndarray
    header: dict = field(repr=False, default_factory=dict)


def _no_dups(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _bad_constant(name):
    raise ValueError(f"non-finite number {name}")


def _read_header(f, path: str, size: int) -> tuple[dict, int]:
    version, _flags, hlen = read_prefix(f, path)
    if version != 1:
        raise fail(f"not a v1 .entity (version {version})", path, 8)
    if hlen > size - PREFIX.size:
        raise fail(f"header length {hlen} exceeds the file", path, 12)
    if hlen > MAX_HEADER_LEN:
        raise LimitExceededError(f"v1 header length {hlen} > {MAX_HEADER_LEN}", path=path)
    raw = f.read(hlen)
    items = raw.count(b"[") + raw.count(b"{") + raw.count(b",")
    if items > MAX_V1_ITEMS:
        raise LimitExceededError(
            f"v1 header holds up to {items} values (limit {MAX_V1_ITEMS})", path=path
        )
    try:
        header = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_dups, parse_constant=_bad_constant
        )
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise fail(f"bad v1 JSON header: {exc}", path, PREFIX.size) from exc
    if not isinstance(header, dict) or header.get("format_version") != 1:
        raise fail("v1 header must be an object with format_version 1", path, PREFIX.size)
    return header, PREFIX.size + hlen


def _int(d: dict, key: str, path: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if type(v) is not int or v < 0:
        raise fail(f"v1 header: {key} must be a non-negative integer, got {v!r}", path)
    return v


def _num(d: dict, key: str, default: float) -> float:
    v = d.get(key) or default
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _config(header: dict, path: str, max_seq_len: int | None) -> TransformerConfig:
    spec = header.get("transformer")
    if not isinstance(spec, dict) or not isinstance(spec.get("dims"), dict):
        raise fail("v1 file has no transformer section (network-only checkpoint)", path)
    dims = spec["dims"]
    heads = _int(dims, "num_heads", path)
    try:
        return TransformerConfig(
            vocab_size=_int(spec, "vocab_size", path),
            hidden_size=_int(spec, "hidden_size", path),
            intermediate_size=_int(dims, "intermediate_size", path),
            num_layers=_int(dims, "num_layers", path),
            num_heads=heads,
            num_kv_heads=_int(dims, "num_kv_heads", path, heads),
            head_dim=_int(dims, "head_dim", path, 0),
            rms_norm_eps=_num(dims, "rms_norm_eps", 1e-6),
            rope_theta=_num(dims, "rope_freq_base", 10000.0),
            max_seq_len=max_seq_len or 2048,
            tie_word_embeddings=bool(spec.get("lm_head_tied", False)),
            architecture="llama",
        )
    except (LayerConfigError, TypeError) as exc:
        raise fail(f"v1 transformer dims invalid: {exc}", path) from exc


def _blob_table(header: dict, data_start: int, size: int, path: str) -> dict[str, dict]:
    blobs = header.get("blobs")
    if not isinstance(blobs, list):
        raise fail("v1 header: blobs must be a list", path)
    table: dict[str, dict] = {}
    spans = []
    for rec in blobs:
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), str):
            raise fail("v1 header: bad blob record", path)
        off, length = _int(rec, "offset", path), _int(rec, "length", path)
        start = data_start + off  # v1 offsets are relative to the payload start
        if start + length > size:
            raise fail(f"blob {rec['path']!r} runs past the end of the file", path, start)
        if rec["path"] in table:
            raise fail(f"duplicate blob path {rec['path']!r}", path)
        table[rec["path"]] = dict(rec, start=start)
        spans.append((start, start + length, rec["path"]))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise fail(f"blobs {a!r} and {b!r} overlap", path, start)
    return table


def q4_0_decode(raw: bytes | np.ndarray, count: int, path: str = "") -> np.ndarray:
    """Decode a Loom Q4_0 blob (§4.6) to float32 [count]."""
    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if buf.size < 8:
        raise fail("Q4_0 blob shorter than its 8-byte counts", path)
    n_scales, n_words = (int(x) for x in buf[:8].view("<u4"))
    nblocks = -(-count // Q4_BLOCK)
    if n_scales != nblocks or n_words < 4 * nblocks or buf.size != 8 + 4 * (n_scales + n_words):
        raise fail(f"Q4_0 blob counts ({n_scales}, {n_words}) do not fit {count} weights", path)
    scales = buf[8 : 8 + 4 * n_scales].view("<f4")
    if not np.all(np.isfinite(scales)):
        raise fail("Q4_0 blob has a non-finite scale", path)
    packed = buf[8 + 4 * n_scales : 8 + 4 * n_scales + 16 * nblocks].reshape(nblocks, 16)
    # byte k of a block: element 2k in the low nibble, 2k+1 in the high nibble, two's complement
    nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(nblocks, Q4_BLOCK)  # [b, 32]
    codes = nib.astype(np.int8)
    codes[codes > 7] -= 16
    values = codes.astype(np.float32) * scales[:, None]  # [b, 32]
    return values.reshape(-1)[:count]


def _loom_spec(cfg: TransformerConfig, role: str) -> list[tuple[str, tuple[int, ...]]]:
    """Loom's master layout (§1.7) per role: poly's, but q/k norms are not in the Loom master."""
    return list(role_shapes(dataclasses.replace(cfg, qk_norm=False), role).items())


def _carve(flat: np.ndarray, spec) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for name, shape in spec:
        n = math.prod(shape)
        out[name] = flat[off : off + n].reshape(shape)  # [*shape]
        off += n
    return out


class _Reader:
    def __init__(self, f, path: str, table: dict[str, dict]):
        self.f, self.path, self.table = f, path, table

    def raw(self, rec: dict) -> np.ndarray:
        self.f.seek(rec["start"])
        data = self.f.read(rec["length"])
        if len(data) != rec["length"]:
            raise fail(f"truncated blob {rec['path']!r}", self.path, rec["start"])
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, name: str, count: int) -> np.ndarray:
        rec = self.table.get(name)
        if rec is None:
            raise fail(f"blob {name!r} missing", self.path)
        raw, dtype = self.raw(rec), rec.get("dtype", "float32")
        if dtype == "Q4_0":
            return q4_0_decode(raw, count, self.path)
        if not rec.get("native", False):
            dtype = "float32"  # non-native blobs are raw float32 (§4.4)
        try:
            return loom_decode(raw, parse_dtype(dtype), count, rec.get("scale"))
        except (EntityFormatError, DTypeError) as exc:
            raise fail(f"blob {name!r}: {exc}", self.path) from exc

    def layer(self, cfg: TransformerConfig, i: int, role: str) -> dict[str, np.ndarray]:
        spec = _loom_spec(cfg, role)
        sizes = {name: math.prod(shape) for name, shape in spec}
        base = f"layers.{i}"
        if base in self.table:
            comps = _carve(self.decode(base, sum(sizes.values())), spec)
        else:
            comps = {n: np.zeros(s, np.float32) for n, s in spec}
            for key, comp in Q4_KEYS.items():
                if comp in comps:
                    flat = self.decode(f"{base}.q4_0.{key}", sizes[comp])
                    comps[comp] = flat.reshape(comps[comp].shape)
            if role == "mlp":
                tail = [(n, s) for n, s in spec if n.startswith("b_")]  # the bias tail, 2I+h
                count = sum(sizes[n] for n, _ in tail)
                comps.update(_carve(self.decode(f"{base}.biases", count), tail))
        if role == "attn":
            for norm in ("q_norm", "k_norm"):
                if f"{base}.{norm}" in self.table:
                    comps[norm] = self.decode(f"{base}.{norm}", cfg.head_dim)
        return comps


def read_entity_v1(path: str | os.PathLike, *, max_seq_len: int | None = None) -> V1Checkpoint:
    """Decode a Loom v1 `.entity` transformer checkpoint into float32 arrays."""
    path = str(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise fail(f"cannot open: {exc.strerror}", path) from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        header, data_start = _read_header(f, path, size)
        cfg = _config(header, path, max_seq_len)
        rd = _Reader(f, path, _blob_table(header, data_start, size, path))
        blocks = [
            {role: rd.layer(cfg, 4 * b + k, role) for k, role in enumerate(ROLES)}
            for b in range(cfg.num_layers)
        ]
        qk = [("q_norm" in blk["attn"]) for blk in blocks]
        if any(qk) and not all(qk):
            raise fail("q_norm/k_norm present on some blocks only", path)
        table = global_shapes(cfg)
        vh = math.prod(table["embeddings"])
        emb = rd.decode("transformer.embeddings", vh).reshape(table["embeddings"])
        head = None
        if "transformer.lm_head" in rd.table:
            head = rd.decode("transformer.lm_head", vh).reshape(table["lm_head"])
        if header["transformer"].get("has_final_norm") or "transformer.final_norm" in rd.table:
            final = rd.decode("transformer.final_norm", cfg.hidden_size)
        else:
            final = np.ones(cfg.hidden_size, np.float32)  # has_final_norm false: identity gamma
    biased = any(np.any(blk["attn"][b]) for blk in blocks for b in ("b_q", "b_k", "b_v", "b_o"))
    cfg = dataclasses.replace(cfg, qk_norm=all(qk) and bool(qk), attention_bias=biased,
                   tie_word_embeddings=head is None)  # fmt: skip
    return V1Checkpoint(cfg, blocks, emb, head, final, header)


def load_entity_v1(path: str | os.PathLike, *, max_seq_len: int | None = None):
    """Load a Loom v1 `.entity` as a float32 `poly.Transformer` (no tokenizer: v1 has none)."""
    from poly.model.transformer import Transformer
    from poly.nn import layout

    ck = read_entity_v1(path, max_seq_len=max_seq_len)
    tf = Transformer.from_config(ck.config)
    for i, blk in enumerate(ck.blocks):
        targets = {
            "attn_norm": layout.rmsnorm(tf.attn_norm(i)).as_dict(),
            "attn": layout.mha(tf.attn(i)).as_dict(),
            "mlp_norm": layout.rmsnorm(tf.mlp_norm(i)).as_dict(),
            "mlp": layout.swiglu(tf.mlp(i)).as_dict(),
        }
        for role, comps in blk.items():
            for name, value in comps.items():
                targets[role][name][...] = value
    tf.embeddings = ck.embeddings
    tf.lm_head = ck.embeddings if ck.lm_head is None else ck.lm_head
    tf.final_norm = ck.final_norm
    tf.generation_defaults = GenerationDefaults()  # v1 files carry no generation settings
    tf.source = {"format": "entity-v1", "path": str(path), "weight_dtype": _wd(ck.header)}
    return tf


def _wd(header: dict) -> str:
    spec = header.get("transformer") or {}
    return str(spec.get("weight_dtype", "float32"))
