"""Every GGUF type llama.cpp's quantizer writes for its usual presets has a C kernel reading its
stored blocks: dequantization bitwise equal to gguf-py's numpy dequantizers (random blocks, and
real files written by llama.cpp's own quantizer), and the matrix-vector kernel equal to
x @ dequantize().T."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from poly.quant.qtensor import GGUFMatrix
from poly.runtime import ckernels

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]

_T = GGMLQuantizationType
PRESET_TYPES = [
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.IQ4_NL, _T.IQ4_XS,
]  # fmt: skip
# llama_ftype ids of the presets (llama.h): Q4_0 Q4_1 Q8_0 Q5_0 Q5_1 Q2_K Q3_K_M Q4_K_M Q5_K_M
# Q6_K IQ4_NL IQ4_XS F16 BF16 Q3_K_S Q4_K_S
PRESETS = (2, 3, 7, 8, 9, 10, 12, 15, 17, 18, 25, 30, 1, 32, 11, 14)
# and MXFP4 (GPT-OSS's experts; llama.cpp's MXFP4_MOE preset quantizes only the experts)
KERNEL_TYPES = [*PRESET_TYPES, _T.MXFP4]


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Bitwise equal, NaNs only in the same places (their payloads may differ)."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def _reference(raw: np.ndarray, qtype, shape) -> np.ndarray:
    with np.errstate(all="ignore"):  # random blocks may hold inf/nan scales
        return np.asarray(quants.dequantize(raw, qtype), np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_random_blocks_dequantize_bitwise_like_gguf_py(qtype, each_isa):
    """Any bytes at all (random scales too: inf, nan, subnormal, -0.0)."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    m, k = 29, 1024
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (m, k // block * size), np.uint8)
    qt = GGUFMatrix(raw, qtype, (m, k))
    assert ckernels.dequantize_supported(qt) and ckernels.supports(qt)
    for a, b in ((0, m), (3, 17), (28, 29)):
        for threads in (1, 2):
            _same_bits(
                ckernels.dequantize(qt, a, b, threads=threads),
                _reference(raw[a:b], qtype, (b - a, k)),
            )


def _finite_blocks(qtype, m: int, k: int, seed: int) -> np.ndarray:
    """Random blocks; blocks decoding to inf/nan are zeroed (all-zero bytes decode to 0)."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if block == 1:  # float types: random bytes would overflow float32 sums
        return quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).view(np.uint8)
    raw = rng.integers(0, 256, (m, k // block, size), np.uint8)
    if qtype == _T.MXFP4:  # exponents near 1 (every exponent: tests/test_mxfp4.py): sums in range
        raw[:, :, 0] = rng.integers(112, 140, (m, k // block))
    vals = _reference(raw.reshape(-1, size), qtype, (m, k // block, block))
    raw[~np.isfinite(vals).all(axis=-1)] = 0
    return raw.reshape(m, -1)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", (1, 2, 7, 13, 16))  # register tiles of 8/4 rows, then 4, 2, 1
def test_matvec_kernel_equals_dequantize_then_dot(qtype, n, each_isa, float_path):
    m, k = 45, 512
    raw = _finite_blocks(qtype, m, k, seed=n)
    qt = GGUFMatrix(raw, qtype, (m, k))
    w = _reference(raw, qtype, (m, k)).astype(np.float64)
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(ckernels.matmul(qt, x, q8=False), ref, rtol=1e-5, atol=tol)
    np.testing.assert_allclose(qt.matmul(x), ref, rtol=1e-5, atol=tol)  # registered kernel
    x40 = np.random.default_rng(0).standard_normal((40, k)).astype(np.float32)  # prefill path
    ref40 = x40.astype(np.float64) @ w.T
    np.testing.assert_allclose(qt.matmul(x40), ref40, rtol=1e-4, atol=1e-5 * np.abs(ref40).max())


# --- real files: llama.cpp's quantizer, from an F32 GGUF ----------------------------------------


def _tiny_llama_f32(path) -> None:
    """A one-block llama-shaped F32 GGUF (random weights; rows of 256 so K-quants apply)."""
    rng = np.random.default_rng(0)
    h, f, heads, kvh = 256, 512, 4, 2
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_block_count(1)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_vocab_size(256)

    def mat(name, rows, cols):
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))

    mat("token_embd.weight", 256, h)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(h, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(h, np.float32))
    kv = kvh * h // heads
    for name, rows, cols in (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h)):
        mat(f"blk.0.{name}.weight", rows, cols)
    for name, rows, cols in (("attn_output", h, h), ("ffn_gate", f, h), ("ffn_up", f, h)):
        mat(f"blk.0.{name}.weight", rows, cols)
    mat("blk.0.ffn_down.weight", h, f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama_quantized(tmp_path_factory) -> list:
    llama_cpp = pytest.importorskip("llama_cpp")
    d = tmp_path_factory.mktemp("llama-quant")
    src = d / "f32.gguf"
    _tiny_llama_f32(src)
    out = [src]
    for ftype in PRESETS:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 1
        dst = d / f"ftype{ftype}.gguf"
        assert (
            llama_cpp.llama_model_quantize(
                str(src).encode(), str(dst).encode(), ctypes.byref(params)
            )
            == 0
        )
        out.append(dst)
    return out


def test_llama_cpp_files_dequantize_bitwise_and_multiply(llama_quantized, each_isa):
    seen = set()
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    for path in llama_quantized:
        for t in GGUFReader(str(path)).tensors:
            if len(t.shape) != 2:
                continue
            shape = (int(t.shape[1]), int(t.shape[0]))  # numpy order [rows, cols]
            raw = np.asarray(t.data).reshape(shape[0], -1).view(np.uint8)
            qt = GGUFMatrix(raw, t.tensor_type, shape)
            want = _reference(raw, t.tensor_type, shape)
            _same_bits(ckernels.dequantize(qt, 0, shape[0]), want)
            xs = x[:, : shape[1]]
            ref = xs.astype(np.float64) @ want.astype(np.float64).T
            got = ckernels.matmul(qt, np.ascontiguousarray(xs), q8=False)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            seen.add(t.tensor_type)
    assert seen >= set(PRESET_TYPES), (
        f"presets wrote no {sorted(t.name for t in set(PRESET_TYPES) - seen)}"
    )


# --- runtime instruction-set dispatch ----------------------------------------------------------


def _isa_in_subprocess(env_value: str | None) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "POLY_ISA"}
    if env_value is not None:
        env["POLY_ISA"] = env_value
    code = "from poly.runtime import ckernels; print(ckernels.info()['isa'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_poly_isa_caps_the_build_chosen_at_import():
    have = ckernels.isas()
    assert have[0] == "base" and ckernels.info()["isa"] in have
    best = have[-1]
    assert _isa_in_subprocess(None) == best
    assert _isa_in_subprocess("auto") == best
    assert _isa_in_subprocess("base") == "base"
    if "avx2" in have:  # forcing the AVX2 kernels on an AVX-512 machine
        assert _isa_in_subprocess("avx2") == "avx2"
    assert _isa_in_subprocess("avx512") == best  # a cap above the CPU is lowered to it


def test_unknown_build_is_a_usage_error():
    from poly.errors import UsageError

    with pytest.raises(UsageError):
        ckernels.use_isa("sse9")


def test_the_matrix_type_table_is_what_gguf_py_dequantizes():
    # opening a file checks the table, not gguf-py (its import is ~40 ms of an open): every type
    # the table lets in must be one gguf-py's reference path decodes
    from poly.quant.ggml import GGUF_MATRIX_TYPES
    from poly.quant.qtensor import gguf_supported

    assert GGUF_MATRIX_TYPES <= gguf_supported()
    assert {GGMLQuantizationType.Q4_K.value, GGMLQuantizationType.IQ4_XS.value} <= {
        int(t) for t in GGUF_MATRIX_TYPES
    }
