"""The GGML tensor types of the GGUF format: ids and block geometry (ggml.h, the GGUF spec).

Our own table, so that poly's core does not import the `gguf` package (its import pulls in yaml
and its whole writer: ~5 MB of every process, each tensor-parallel rank included); equal to
`gguf.constants` on every type both know (tests/test_ggml_types.py). IntEnum: a member equals
and hashes as its id, so the tables of both libraries take either. MXFP4 (GPT-OSS's experts) is
dequantized here in numpy, in both its GGUF and its HF checkpoint layout.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from poly.errors import WeightMappingError


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# type -> (weights per block, bytes per block)
QUANT_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
}

# The types a GGUFMatrix holds, checked against gguf-py's dequantizer by a test (asking it at
# every open imported gguf-py): plain and integer tensors and blocks it cannot decode out.
GGUF_MATRIX_TYPES = frozenset(GGMLType) - {
    GGMLType.F64, GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64,
    GGMLType.Q1_0, GGMLType.Q8_1, GGMLType.Q8_K,
}  # fmt: skip


# --- MXFP4 (OCP microscaling: 32 e2m1 values sharing one e8m0 exponent) -------------------------

# e2m1 codes -> value x2 (ggml's kvalues_mxfp4; the halved scale below undoes the x2)
_E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as float32, exact for every byte (ggml_e8m0_to_fp32_half; e < 2 subnormal)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize_mxfp4(raw: np.ndarray, row_len: int) -> np.ndarray:
    """GGUF MXFP4 rows (ggml type 39) -> float32 [rows, row_len]. A block is 17 bytes: the e8m0
    exponent, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31."""
    blocks = np.asarray(raw).view(np.uint8).reshape(-1, 17)  # [nb, 17]
    qs = blocks[:, 1:]  # [nb, 16]
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)  # [nb, 32]
    with np.errstate(over="ignore"):  # exponent 255 times 6: inf, as in ggml
        vals = _E2M1_X2[codes] * _e8m0_half(blocks[:, :1])  # [nb, 32]
    return vals.reshape(-1, row_len)


def dequantize_mxfp4_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS checkpoint MXFP4 (``*_blocks`` [..., G, 16] uint8, ``*_scales`` [..., G] uint8) ->
    float32 [..., G*32] (transformers' integrations/mxfp4.py: low nibble = even value, high
    nibble = odd value, times 2^(scale - 127)), in the stored row order."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales, np.uint8)
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise WeightMappingError(
            f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} (mxfp4_shape)"
        )
    codes = np.stack([blocks & np.uint8(0x0F), blocks >> np.uint8(4)], axis=-1)  # [..., G, 16, 2]
    vals = _E2M1_X2[codes.reshape(*blocks.shape[:-1], 32)] * _e8m0_half(scales)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
