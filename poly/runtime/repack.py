"""GGUF Q4_0/Q4_1/Q8_0 and int8 (.entity q8) rows regrouped 16 at a time for the fused step's
integer row kernels (csrc/formats/interleave16.h): a lane per row, a 32-block's integer dot
product in its row's lane, the block scale on 16 rows in one FMA. Made once per matrix when the
fused plan is built (`fused_args.mat`, kept as the QTensor's `repacked16`); the stored rows are
released, and a prompt's GEMM dequantizes the copy. Float16/float32 rows mapped from a file are
laid out by 16, k-major (`float_kmajor16`, csrc/formats/float_kmajor16.h): the gemm panels'."""

from __future__ import annotations

import weakref

import numpy as np

from poly.runtime import ckernels, repack_records, tied
from poly.runtime.ckernels import F16, F32, I8, LOOM_Q4, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0

# bytes of a record: per 16 rows and 32-block (interleave16.h), 8 rows and super-block (by 8)
INTERLEAVE16_REC = 320  # Q4_1: D[16], M[16] float16 and the codes: the stored size
INTERLEAVE16_REC4 = 288  # Q4_0 and Loom Q4: D[16] float16 and the codes (M = -8 D in the tiles)
INTERLEAVE16_REC8 = 544  # Q8_0: D[16] float16 and 8 x 64 code bytes: the stored size
INTERLEAVE16_REC_I8 = 512  # int8 rows (.entity q8): 8 x 64 code bytes (the scales are per row)
KQUANT_INTERLEAVE8_REC = 1184  # Q4_K
KQUANT_INTERLEAVE8_Q6_REC = 1680  # Q6_K: the stored 8 x 210


def _mapping(arr: np.ndarray):
    """The open read-only mmap.mmap that `arr` views (through np.memmap, memoryview or ndarray
    bases), or None. Read-only: a file's pages, dropped and read again unchanged; an anonymous
    or copy-on-write mapping (poly.weights' huge-page buffers) would lose its bytes."""
    import mmap

    b = arr
    while b is not None and not isinstance(b, mmap.mmap):
        mm = getattr(b, "_mmap", None)
        nxt = "obj" if isinstance(b, memoryview) else "base"
        b = mm if isinstance(mm, mmap.mmap) else getattr(b, nxt, None)
    if b is None or not hasattr(b, "madvise") or b.closed:
        return None
    if hasattr(b, "release"):  # a poly.filesnapshot.FileSnapshot: hands pages back to its file
        return b
    return b if memoryview(b).readonly else None


def release_mapped(arr: np.ndarray) -> None:
    """Drop the whole pages of `arr` from this process when it views a read-only file mapping
    (an mmap.mmap or np.memmap base), or the file's own pages back over a FileSnapshot's: they
    stay in the page cache and fault back in when read."""
    import mmap

    if (b := _mapping(arr)) is None:
        return
    a0 = arr.ctypes.data - (getattr(b, "address", None) or np.frombuffer(b, np.uint8).ctypes.data)
    page = mmap.PAGESIZE
    p0, p1 = -(-a0 // page) * page, (a0 + arr.nbytes) // page * page
    if 0 <= p0 < p1:
        if hasattr(b, "release"):
            b.release(p0, p1 - p0)
        else:
            b.madvise(mmap.MADV_DONTNEED, p0, p1 - p0)


def interleave16(
    kind: int, raw: np.ndarray, m: int, k: int, aux: np.ndarray | None = None, owner=None
) -> np.ndarray | None:
    """Q4_0/Q4_1/Q8_0 rows regrouped 16 at a time for csrc/formats/interleave16.h (the fused step's decode
    and prompt rows on int8 codes of x, every SIMD build), or None where this build or
    shape does not take them. Per 16 rows and 32-block: D[16] as float16, then for Q4_1 M[16]
    as float16 (Q4_0: no M, the tiles take -8 D), then the codes as 64-byte vectors, byte 4 r + i of vector q = stored code byte
    4 q + i of row r (4 vectors of Q4 bytes, 8 of Q8_0 codes). The stored rows' pages are then released (`release_mapped`):
    read once here, they stay out of the resident set (a prompt's GEMM reads the copy). int8
    rows with a scale per row (.entity q8, kind I8: `raw` the [m, k] codes): the codes alone (`_repack_i8`). Loom Q4 (.entity q4, `aux` its float32 block scales): Q4_0's
    record, D[16] rounded to float16 (`_repack_loom`). float16/float32 rows: `float_kmajor16`
    when `owner` (the weight object the copy lives with) is given."""
    if kind in (F16, F32):
        return None if owner is None else float_kmajor16(kind, owner, raw, m, k)
    ok = kind in (Q4_0, Q4_1, Q8_0, I8, LOOM_Q4) and not (m % 16 or k % 32)
    if not (ok and ckernels.AVAILABLE and ckernels.EXT.info().get("interleave16")):
        return None
    if kind == I8:
        return _repack_i8(raw, m, k)
    if kind == LOOM_Q4:
        return None if aux is None else _repack_loom(raw, aux, m, k)
    nb, g = k // 32, m // 16
    bb, nq = {Q4_0: (18, 4), Q4_1: (20, 4), Q8_0: (34, 8)}[kind]  # block bytes, code quads
    fast = _records_in_c(kind, raw, m, k)
    if fast is not None:
        return fast
    blocks = np.asarray(raw).reshape(m, nb, bb)  # the stored bytes [m, nb, block]
    fields = [_field(blocks, 0)]  # D as float16 bits [m, nb]; Q4_0: D alone (M = -8 D)
    if kind == Q4_1:
        fields.append(_field(blocks, 2))
    out = np.empty((g, nb, 32 * len(fields) + 64 * nq), dtype=np.uint8)
    for j, v in enumerate(fields):
        _place_fields(out, 32 * j, v)
    _place_codes(out, 32 * len(fields), blocks[..., bb - 4 * nq :])
    release_mapped(raw)
    return out


# Element-wise copies into views of the record array `out` [g, nb, bytes] (no transposed
# temporaries: a 49,152-row head's would double the peak memory of a repack). The 2-byte fields
# move as uint16 and the code quads as uint32: numpy's strided copy costs per element, so
# moving single bytes is several times slower (benchmarks/results/results-first-turn-*.json).
def _place_fields(out: np.ndarray, at: int, v: np.ndarray) -> None:
    """A 2-byte field per row and 32-block, v [m, nb] (any 2-byte dtype), as
    out[..., at : at + 32]: row r's at bytes 2 r, 2 r + 1 (the record's D[16] or M[16])."""
    g, nb = out.shape[:2]
    rows = v.view(np.uint16).reshape(g, 16, nb).transpose(0, 2, 1)  # [g, nb, row]
    out.view(np.uint16)[..., at // 2 : at // 2 + 16] = rows


def _field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The 2-byte field at byte `at` of each block, blocks [m, nb, bytes] -> uint16 [m, nb]
    (a view of the stored bytes)."""
    return blocks[..., at : at + 2].view(np.uint16)[..., 0]


def _place_codes(out: np.ndarray, at: int, codes: np.ndarray) -> None:
    """Code bytes [m, nb, 4 nq] as out[..., at:], nq vectors of 64 bytes: byte 4 r + i of
    vector q = code byte 4 q + i of row r's block (a row's 4-byte quads move whole)."""
    g, nb = out.shape[:2]
    c = codes.view(np.uint32).reshape(g, 16, nb, -1)  # [g, row, nb, q]
    dst = out.view(np.uint32)[..., at // 4 :].reshape(g, nb, c.shape[3], 16)  # [g, nb, q, row]
    dst[...] = c.transpose(0, 2, 3, 1)


def copy_for(w, kind: int, data: np.ndarray, m: int, k: int, aux, by16: bool) -> np.ndarray | None:
    """The copy of `w`'s rows the fused step reads (`_mat`'s rp), made once per matrix and kept
    on w: Q4_K/Q6_K rows by 8 (`w.kquant_interleave8`: the decode rows and the prompt panels;
    not for experts, by16 False), the other kinds by 16 (`w.repacked16`: interleave16 records, or
    float_kmajor16 rows for float kinds; a prompt's GEMM reads it too), or None."""
    order = getattr(w, "order", None)  # rows reordered: cached by the file's rows and the order
    key = (data, b"") if order is None else (w.stored, np.asarray(order).tobytes())
    if kind in (Q4_K, Q6_K):
        if not hasattr(w, "kquant_interleave8"):
            w.kquant_interleave8 = _cached(kind, data, m, k, aux, key) if by16 else None
        return w.kquant_interleave8
    rp = getattr(w, "repacked16", None)
    if rp is None and not hasattr(w, "repacked16"):
        if kind in (F16, F32) or not by16 or kind not in _RECORDS:
            rp = interleave16(kind, data, m, k, aux, w if by16 else None)
        else:
            rp = _cached(kind, data, m, k, aux, key)
        w.repacked16 = rp
        rows = None if rp is None else tied.records_rows(kind, rp, w, data, k)
        if rows is not None:  # a tied table's stored rows need not stay pinned
            tied.serve(w, rows)
            tied.unpin(_mapping(data), data)
            release_mapped(data)
    return rp


# (rows, columns, bytes) of one record of each kind's repacked rows (kquant_interleave8,
# kquant_interleave8_q6, interleave16)
_RECORDS = {Q4_K: (8, 256, KQUANT_INTERLEAVE8_REC), Q6_K: (8, 256, KQUANT_INTERLEAVE8_Q6_REC),
            Q4_0: (16, 32, INTERLEAVE16_REC4), LOOM_Q4: (16, 32, INTERLEAVE16_REC4),
            Q4_1: (16, 32, INTERLEAVE16_REC), Q8_0: (16, 32, INTERLEAVE16_REC8),
            I8: (16, 32, INTERLEAVE16_REC_I8)}  # fmt: skip


def _records_in_c(kind: int, raw: np.ndarray, m: int, k: int) -> np.ndarray | None:
    """`kind`'s records made by the C extension (`repack_records`), the stored rows released as
    the numpy copies below release them; None where the extension makes none."""
    out = repack_records.make(kind, raw, m, k, _RECORDS[kind])
    if out is not None:
        release_mapped(raw)
    return out


def _cached(kind: int, data: np.ndarray, m: int, k: int, aux, key: tuple) -> np.ndarray | None:
    """The repacked rows of `kind` (kquant_interleave8, kquant_interleave8_q6 or interleave16)
    from the layout cache, else made and written there. `key`: (file rows, extra bytes) naming
    them there: `data`, or the stored rows and the order `data` holds them in (`ordered_rows`)."""
    from poly.runtime import layout_cache  # hashlib, json, shutil, tempfile: not at start

    rows, cols, rec = _RECORDS[kind]
    name = f"{'kquant_interleave8' if rows == 8 else 'interleave16'}-{kind}"  # the file's layout
    src, extra = key
    if not (m % rows or k % cols):
        got = layout_cache.load(src, name, (m // rows, k // cols, rec), np.uint8, extra)
        if got is not None:
            release_mapped(data)  # as the repackers do: the copy serves, the stored rows leave
            return got
    if kind in (Q4_K, Q6_K):
        out = (kquant_interleave8 if kind == Q4_K else kquant_interleave8_q6)(data, m, k)
    else:
        out = interleave16(kind, data, m, k, aux)
    if out is not None:
        layout_cache.store(src, name, out, extra)
    return out


def ordered_rows(stored: np.ndarray, order: np.ndarray) -> np.ndarray:
    """`stored[order]` (a GGUF's q/k rows, llama.cpp's permutation undone): mapped from the layout
    cache when an earlier open made it, else copied and written there; `stored` released."""
    from poly.runtime import layout_cache

    extra = np.asarray(order).tobytes()
    out = layout_cache.load(stored, "rows", stored.shape, np.uint8, extra)
    if out is None:
        out = np.ascontiguousarray(stored[order])
        layout_cache.store(stored, "rows", out, extra)
    release_mapped(stored)
    return out


def _by8(m: int, k: int) -> bool:
    """Whether this build reads [m, k] K-quant rows by 8 (csrc/formats/kquant_interleave8.h)."""
    return (
        not (m % 8 or k % 256)
        and ckernels.AVAILABLE
        and bool(ckernels.EXT.info().get("kquant_interleave8"))
    )


def kquant_interleave8(raw: np.ndarray, m: int, k: int) -> np.ndarray | None:
    """GGUF Q4_K rows [m, k] regrouped 8 at a time for csrc/formats/kquant_interleave8.h (the auto mode's decode
    rows, one vector lane per row), or None where this build or shape takes none. Per 8 rows and
    super-block: D[8], Dmin[8] as float16, the 6-bit scales (byte 8 j + r) and mins (byte 16 i +
    2 r + e: sub-block 2 i + e) unpacked, then 32 code vectors, byte 4 r + b of vector 8 i + t =
    stored code byte 32 i + 4 t + b of row r. A prompt's int8 panels decode the records too
    (csrc/formats/kquant_interleave8_panels.h), so the stored rows' pages are released (`release_mapped`): one copy of
    the weights resident, not two."""
    if not _by8(m, k):
        return None
    g, ns = m // 8, k // 256
    fast = _records_in_c(Q4_K, raw, m, k)
    if fast is not None:
        return fast
    blocks = np.asarray(raw).reshape(g, 8, ns, 144)  # the stored bytes [group, row, sb, block]
    out = np.empty((g, ns, KQUANT_INTERLEAVE8_REC), dtype=np.uint8)
    for j, lo in enumerate((0, 2)):  # D, Dmin: [g, 8, ns, 2] -> [g, ns, 8 rows, 2]
        half = blocks[..., lo : lo + 2]
        out[..., 16 * j : 16 * j + 16].reshape(g, ns, 8, 2)[...] = half.transpose(0, 2, 1, 3)
    q = blocks[..., 4:16].transpose(0, 2, 1, 3).astype(np.uint8)  # [g, ns, row, 12]
    sc = np.empty((g, ns, 8, 8), dtype=np.uint8)  # [g, ns, row, j]
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    out[..., 32:96].reshape(g, ns, 8, 8)[...] = sc.transpose(0, 1, 3, 2)  # byte 8 j + r
    pairs = mn.reshape(g, ns, 8, 4, 2)  # [g, ns, row, i, e]
    out[..., 96:160].reshape(g, ns, 4, 8, 2)[...] = pairs.transpose(0, 1, 3, 2, 4)
    codes = blocks[..., 16:].reshape(g, 8, ns, 32, 4)  # [g, row, sb, 8 i + t, b]
    out[..., 160:].reshape(g, ns, 32, 8, 4)[...] = codes.transpose(0, 2, 3, 1, 4)
    release_mapped(raw)
    return out


def kquant_interleave8_q6(raw: np.ndarray, m: int, k: int) -> np.ndarray | None:
    """GGUF Q6_K rows [m, k] regrouped 8 at a time for csrc/formats/kquant_interleave8.h (the auto mode's decode
    rows and the prompt panels), or None where this build or shape takes none. Per 8 rows and
    super-block: D[8] as float16, the int8 scales (byte 16 i + 2 r + e: 16-group 2 i + e of row
    r), then the 6-bit codes in natural order, three vectors per 16-group j: byte 4 r + b of
    vector 3 j + k holds the code of element 16 j + 4 k + b in bits 0-5 and bits 4 - 2 k,
    5 - 2 k of the code of element 16 j + 12 + b in bits 6-7. As many bytes as stored. The
    stored rows' pages are released as kquant_interleave8's."""
    if not _by8(m, k):
        return None
    g, ns = m // 8, k // 256
    fast = _records_in_c(Q6_K, raw, m, k)
    if fast is not None:
        return fast
    blocks = np.asarray(raw).reshape(g, 8, ns, 210)  # the stored bytes [group, row, sb, block]
    out = np.empty((g, ns, KQUANT_INTERLEAVE8_Q6_REC), dtype=np.uint8)
    d = blocks[..., 208:210]  # [g, row, ns, 2] -> [g, ns, row, 2]
    out[..., 0:16].reshape(g, ns, 8, 2)[...] = d.transpose(0, 2, 1, 3)
    sc = blocks[..., 192:208].reshape(g, 8, ns, 8, 2)  # [g, row, ns, i, e]
    out[..., 16:144].reshape(g, ns, 8, 8, 2)[...] = sc.transpose(0, 2, 3, 1, 4)
    for g0 in range(0, g, 256):  # bounded temporaries: 256 groups at a time
        sl = slice(g0, g0 + 256)
        c = _q6k_codes(blocks[sl]).reshape(-1, 8, ns, 16, 4, 4)  # [g, row, ns, j, k, b]
        top = c[..., 3, :]
        v = c[..., :3, :] | ((top[..., None, :] >> np.array([4, 2, 0], np.uint8)[:, None]) << 6)
        out[sl, :, 144:].reshape(-1, ns, 16, 3, 8, 4)[...] = v.transpose(0, 2, 3, 4, 1, 5)
    release_mapped(raw)
    return out


def _q6k_codes(blocks: np.ndarray) -> np.ndarray:
    """The 6-bit codes [..., 256] (natural order) of Q6_K blocks [..., 210]: element
    128 h + 32 q + l is nibble q >> 1 of ql[64 h + 32 (q & 1) + l], over bits 2 q of qh[32 h + l]."""
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 2, 32)  # [.., h, q & 1, l]
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)  # [.., h, 1, l]
    lo = np.stack([ql & 15, ql >> 4], axis=-3)  # [.., h, q >> 1, q & 1, l]
    lo = lo.reshape(*blocks.shape[:-1], 2, 4, 32)  # [.., h, q, l]
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [.., h, q, l]
    return (lo | hi << 4).reshape(*blocks.shape[:-1], 256)


def _repack_i8(codes: np.ndarray, m: int, k: int) -> np.ndarray:
    """[m, k] int8 codes by 16 rows and 32-block: 8 vectors of 64 bytes, byte 4 r + i of
    vector q = code 4 q + i of row r's block (Q8_0's record without its scales: those are per
    row)."""
    g, nb = m // 16, k // 32
    c = np.asarray(codes).view(np.uint8).reshape(m, nb, 32)  # [m, nb, 32]
    out = np.empty((g, nb, INTERLEAVE16_REC_I8), dtype=np.uint8)
    _place_codes(out, 0, c)
    release_mapped(codes)
    return out


def _repack_loom(packed: np.ndarray, scales: np.ndarray, m: int, k: int) -> np.ndarray:
    """Loom Q4 blocks (low nibble element 2 j, high 2 j + 1, 4-bit two's complement codes, a
    float32 scale per block) by 16 rows as Q4_0's record: D[16] as float16, then the code
    vectors of code + 8 (element j low, j + 16 high), so the tiles take Q4_0's path with
    M = -8 D. Why float16: the decode rows read 288 bytes a block, not 320 (1B .entity q4
    decode +12 % on Zen 3). Its rounding (2^-12 relative at most) is far below the 4-bit codes'
    own and the auto mode's one code of x (1/254); with q8 on (two codes of x) it is the larger
    error, within 6e-4 of the float rows (tests/test_interleave16.py). A prompt's GEMM reads the stored
    float32 scales (csrc/formats/interleave16_panels.h). None where a scale overflows float16 (the float
    kernels then take the stored rows)."""
    g, nb = m // 16, k // 32
    with np.errstate(over="ignore"):
        d16 = np.asarray(scales, dtype=np.float32).astype(np.float16)
    if not np.isfinite(d16).all():
        return None
    p = np.asarray(packed).reshape(m, nb, 16)
    u = np.empty((m, nb, 32), dtype=np.uint8)  # code + 8 per element
    u[..., 0::2] = p & 15
    u[..., 1::2] = p >> 4
    u ^= 8
    q = u[..., :16] | (u[..., 16:] << 4)  # [m, nb, 16] as Q4_0 stores them
    out = np.empty((g, nb, INTERLEAVE16_REC4), dtype=np.uint8)
    _place_fields(out, 0, d16.reshape(m, nb))
    _place_codes(out, 32, q)
    release_mapped(packed)
    return out


def float_kmajor16_wanted(kind: int, m: int) -> bool:
    """Whether this build lays [m, k] rows of `kind` out by 16, k-major: float32 on the SIMD
    builds and float16 too (info()["float_kmajor16"]: the kinds as bits)."""
    laid = ckernels.EXT.info().get("float_kmajor16", 0) if ckernels.AVAILABLE else 0
    return kind in (F16, F32) and m % 16 == 0 and bool(laid >> kind & 1)


def float_kmajor16(kind: int, w, raw: np.ndarray, m: int, k: int, order=None) -> np.ndarray | None:
    """float16/float32 rows [m, k] as [m / 16, k, 16] (group g: rows 16 g .. 16 g + 15, k-major)
    for csrc/formats/float_kmajor16.h, made once per array, or None where the build or shape takes none or `raw`
    is not mapped from a file (a copy would double the resident weights). The mapped pages are
    then released (`release_mapped`): they stay in the page cache and fault back in if a path
    reads the rows. `w`: the weight object the copy lives with (the array, or its QTensor);
    `order` (optional): row i of the layout is stored row order[i] (a GGUF file's q/k rows)."""
    from poly.runtime import layout_cache  # as in `_cached`: only once a copy is wanted

    key = id(w)
    got = ckernels.FLOAT_KMAJOR16.get(key)
    if got is not None or not float_kmajor16_wanted(kind, m) or _mapping(raw) is None:
        return got
    el = np.uint32 if kind == F32 else np.uint16  # the elements' bits, moved as they are
    table = isinstance(w, np.ndarray) and order is None and w.shape == (m, k)  # a float table
    if table:  # its rows leave as the copy is made (a first open: not the table twice at once)
        tied.unpin(_mapping(w), w)
    extra = b"" if order is None else np.asarray(order).tobytes()
    out = layout_cache.load(raw, "float_kmajor16", (m // 16, k, 16), el, extra)
    if out is not None:
        release_mapped(raw)
    else:
        out = _float_kmajor16_make(raw, el, m, k, order)
        layout_cache.store(raw, "float_kmajor16", out, extra)
    ckernels.FLOAT_KMAJOR16[key] = out
    weakref.finalize(w, ckernels.FLOAT_KMAJOR16.pop, key, None)
    if table:  # its lookups read the copy from now on (`poly.nn.embedding.laid_rows`)
        tied.serve(w, tied.float_rows(out, w.dtype))
        release_mapped(w)
    return out


def _float_kmajor16_make(raw: np.ndarray, el, m: int, k: int, order) -> np.ndarray:
    from poly.weights import aligned_zeros

    out = aligned_zeros(m * k, el).reshape(m // 16, k, 16)  # [g, k, 16]
    src = np.asarray(raw).view(el).reshape(m, k)
    step = max(16, (1 << 20) // (16 * el().nbytes * k) * 16)  # rows a piece: 1 MB, then released
    for r in range(0, m, step):
        rows = slice(r, r + step) if order is None else order[r : r + step]
        piece = src[rows]  # [rows, k]: a view, or the rows gathered in order
        ckernels.EXT.float_kmajor16(
            piece, out[r // 16 : (r + step) // 16], len(piece), k, el().nbytes
        )
        release_mapped(piece if order is None else src[rows.min() : rows.max() + 1])
    return out


def float_kmajor16_stored(w) -> np.ndarray | None:
    """`w.repacked16`: a GGUF float matrix whose file permutes its rows (`GGUFMatrix.order`:
    llama.cpp's q/k) laid out by 16 in the matrix's order straight from the file's mapping (at
    load), so the reordered copy (`w.raw`) is never made: the C side reads the layout alone
    (csrc/decode/matrix.h: hk; `ckernels.laid`). None where the build or shape takes none."""
    kind = ckernels.GGUF_KINDS.get(w.scheme)
    if w.order is None or kind not in (F16, F32):
        return None
    w.repacked16 = float_kmajor16(kind, w, w.stored, int(w.shape[0]), int(w.shape[1]), w.order)
    return w.repacked16
