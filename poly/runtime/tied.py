"""A tied table's lookups read its LM head's repacked copy (issue 62: the largest matrix held
once, not twice). The copy's rows are put back together per lookup: float rows by 16, k-major
(`repack.float_kmajor16`: the same bits), Q8_0 records by 16 (`repack.interleave16`: each
row's blocks, decoded as the stored rows are) and int8 records (`.entity` q8, decoded with the rows' own scales).
The table's own rows, pinned for its lookups until then, go back to the file."""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from poly.nn.embedding import LAID_TABLES
from poly.runtime.ckernels import I8, Q8_0


def serve(w, rows) -> None:
    """`w`'s lookups call rows(ids) from now on (`poly.nn.embedding.laid_rows`)."""
    LAID_TABLES[id(w)] = rows
    weakref.finalize(w, LAID_TABLES.pop, id(w), None)


def unpin(snap, table: np.ndarray) -> None:
    """Forget the pins of `table`'s rows in `snap` (a `poly.filesnapshot.FileSnapshot`, or None)."""
    if snap is not None and hasattr(snap, "unpin"):
        snap.unpin(snap.offset_of(table), table.nbytes)


def float_rows(out: np.ndarray, dtype):
    """rows(ids) of float rows laid out by 16, k-major ([m / 16, k, 16] of their bits)."""
    return lambda ids: out[ids // 16, :, ids % 16].view(dtype)


def records_rows(kind: int, rp: np.ndarray, w, data: np.ndarray, k: int):
    """rows(ids) of `w` from its records by 16 `rp`, or None for a kind not read back here."""
    enc = getattr(w, "encoded", None)
    if kind == Q8_0 and getattr(w, "raw", None) is data:
        return q8_0_rows(rp, k)
    if kind == I8 and enc is not None and enc.codes is data:
        return i8_rows(rp, enc, k)
    return None


def codes_by16(rec: np.ndarray, lane: np.ndarray, at: int) -> np.ndarray:
    """Each row's code bytes [n, nb, 32] out of its records [n, nb, bytes] (lane = row % 16):
    8 vectors of 64 bytes from byte `at`, byte 4 lane + i of vector q = code 4 q + i."""
    n, nb = rec.shape[:2]
    codes = rec[..., at : at + 512].reshape(n, nb, 8, 16, 4)
    return codes[np.arange(n), :, :, lane].reshape(n, nb, 32)


def i8_rows(rp: np.ndarray, enc, k: int):
    """rows(ids) of int8 rows from their records by 16 (`repack._repack_i8`: the codes)."""
    from poly.quant.qtensor import CodedMatrix

    def rows(ids: np.ndarray) -> np.ndarray:
        codes = codes_by16(rp[ids // 16], ids % 16, 0).reshape(len(ids), k).view(np.int8)
        zero = None if enc.zero is None else enc.zero[ids]
        part = dataclasses.replace(enc, shape=(len(ids), k), codes=codes, scales=enc.scales[ids],
                                   zero=zero)  # fmt: skip
        return CodedMatrix(part).dequantize()

    return rows


def q8_0_rows(rp: np.ndarray, k: int):
    """rows(ids) of Q8_0 rows from their records by 16 (D[16], codes): each row's
    stored blocks (D, then its 32 codes) put back together and decoded as stored."""
    from poly.quant.ggml import GGMLType
    from poly.quant.qtensor import GGUFMatrix

    def rows(ids: np.ndarray) -> np.ndarray:
        rec, lane, nb = rp[ids // 16], ids % 16, rp.shape[1]  # [n, nb, 544]
        n = len(ids)
        blocks = np.empty((n, nb, 34), dtype=np.uint8)
        sel = np.arange(n)[:, None, None], np.arange(nb)[None, :, None]
        blocks[..., :2] = rec[(*sel, 2 * lane[:, None, None] + np.arange(2))]  # D[lane]
        blocks[..., 2:] = codes_by16(rec, lane, 32)
        return GGUFMatrix(blocks.reshape(n, -1), GGMLType.Q8_0, (n, k)).dequantize()

    return rows
