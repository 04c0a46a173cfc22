"""The fused C decode step (poly/runtime/fused.py, csrc/decode/step.h) against the Python block path.

Each case runs the same model twice from an empty cache: once with the fused step disabled
(the numpy/BLAS path, itself checked against transformers in test_hf_parity.py) and once with
it, over a prompt and several decode steps, and compares every step's logits."""

from __future__ import annotations

import numpy as np
import pytest

from poly import layout
from poly.errors import ContextOverflowError
from poly.layer import LayerType
from poly.runtime import ckernels, fused, kernels
from tests.test_ckernels import MAKERS, block_of
from tests.tiny_model import decode_call, random_transformer, tiny_cfg

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]

PROMPT = [3, 17, 5, 42, 9, 11]


def run_steps(tf, use_fused: bool, monkeypatch, n: int = 5, prompt=PROMPT) -> list[np.ndarray]:
    with monkeypatch.context() as m:
        if not use_fused:
            m.setattr(fused, "plan", lambda model: None)
        tf.reset()
        out = [tf.forward(prompt)]
        for i in range(n):
            out.append(tf.forward([int(np.argmax(out[-1])) if i % 2 else (7 * i + 1) % 120]))
    return out


def _assert_same(tf, monkeypatch, rtol=1e-5, prompt=PROMPT):
    assert fused.plan(tf) is not None, "the fused step should apply to this model"
    ref = run_steps(tf, False, monkeypatch, prompt=prompt)
    got = run_steps(tf, True, monkeypatch, prompt=prompt)
    scale = max(float(np.abs(r).max()) for r in ref)
    for r, g in zip(ref, got):
        assert g.dtype == np.float32 and g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=0, atol=rtol * scale)
    assert tf.position == len(prompt) + 5


def quantize_all(tf, scheme: str, by_name: dict | None = None) -> None:
    """Every MHA/SwiGLU matrix as a stored version in `scheme`, or by_name[component] (biases
    and gammas float32)."""
    for layer in tf.network.walk():
        if layer.type not in (LayerType.MHA, LayerType.SWIGLU):
            continue
        comps = {}
        for name, view in layout.views(layer).items():
            if view is not None and name in layout.MATRIX_COMPONENTS:
                make = MAKERS[(by_name or {}).get(name, scheme)]
                comps[name] = make(np.ascontiguousarray(view))
            else:
                comps[name] = None if view is None else np.array(view, dtype=np.float32)
        layer.weights.set_version(scheme, comps, activate=True)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # GQA 4/2, untied
        {"num_kv_heads": 1, "tie_word_embeddings": True},  # MQA, tied
        {"attention_bias": True, "architecture": "qwen2"},
        {"qk_norm": True, "head_dim": 24, "architecture": "qwen3"},  # q width 96 != hidden 64
    ],
    ids=["gqa", "mqa-tied", "bias", "qk-norm"],
)
def test_float32_master_matches_python_path(kw, monkeypatch):
    tf = random_transformer(tiny_cfg(**kw), seed=1)
    if kw.get("attention_bias"):
        rng = np.random.default_rng(5)
        for i in range(tf.config.num_layers):
            views = layout.mha(tf.attn(i))
            for b in (views.b_q, views.b_k, views.b_v, views.b_o):
                b[...] = rng.standard_normal(b.shape) * 0.3
    _assert_same(tf, monkeypatch)


@pytest.mark.parametrize("scheme", list(MAKERS))
def test_stored_versions_match_python_path(scheme, monkeypatch, each_isa, float_path):
    big = block_of(scheme) == 256  # K-quants need rows of 256
    tf = random_transformer(tiny_cfg(hidden=256 if big else 64, inter=512 if big else 96), seed=2)
    quantize_all(tf, scheme)
    tf.lm_head = MAKERS[scheme](np.ascontiguousarray(tf.lm_head))
    # the Python path uses the same stored weights; only summation order differs
    _assert_same(tf, monkeypatch, rtol=2e-5)
    # 13 rows in one fused call: register tiles of 8 + 4 + 1 rows for the quantized kinds, gemm
    # panels for the dense ones, which sum each output in one chain over k (~5e-7 relative per
    # product, vs ~1e-7); 3 random layers amplify
    _assert_same(tf, monkeypatch, rtol=1e-4, prompt=[*PROMPT, 8, 1, 2, 60, 33, 7, 19])
    # 20 rows: past MAX_N, every kind's products run as gemm panels
    _assert_same(tf, monkeypatch, rtol=1e-4, prompt=[*PROMPT, *PROMPT, *PROMPT, 8, 1])


K_QUANTS = ["gguf_q2_k", "gguf_q3_k", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k"]


@pytest.mark.parametrize(
    "scheme", ["gguf_q4_1", "loom_q4", "int8", "gguf_q5_0", "gguf_q5_1", "gguf_iq4_nl", *K_QUANTS]
)
def test_int8_activations_stay_close(scheme, monkeypatch, float_path):
    big = block_of(scheme) == 256
    tf = random_transformer(tiny_cfg(hidden=256 if big else 64, inter=512 if big else 96), seed=3)
    quantize_all(tf, scheme)
    ref = run_steps(tf, False, monkeypatch)
    ckernels.set_act_q8(True)  # every row, the prompt's too (K-quants: formats/kquant_rows.h)
    got = run_steps(tf, True, monkeypatch)
    for r, g in zip(ref, got):
        assert np.abs(g - r).max() <= 3e-3 * np.abs(r).max()


def test_fused_step_is_not_taken_when_it_cannot_apply(monkeypatch):
    tf = random_transformer(tiny_cfg(), seed=4)
    assert fused.plan(tf) is not None
    kernels.set_backend("numpy")
    assert fused.plan(tf) is None
    kernels.set_backend("c")
    tf.enable_tiling(16)  # tiled blocks are not plain: the Python path runs them
    assert fused.plan(tf) is None
    tf.disable_tiling()
    assert fused.plan(tf) is not None
    tf.lm_head = MAKERS["float32"](np.ascontiguousarray(tf.lm_head)).array[:, ::1]
    assert fused.plan(tf) is not None


def test_plan_follows_weight_changes(monkeypatch):
    tf = random_transformer(tiny_cfg(), seed=6)
    before = run_steps(tf, True, monkeypatch)
    quantize_all(tf, "int8")  # new active versions: the cached plan must not be reused
    after = run_steps(tf, True, monkeypatch)
    ref = run_steps(tf, False, monkeypatch)
    np.testing.assert_allclose(after[-1], ref[-1], atol=2e-5 * np.abs(ref[-1]).max())
    assert np.abs(after[0] - before[0]).max() > 1e-4


def test_context_overflow_keeps_the_cache():
    tf = random_transformer(tiny_cfg(max_seq_len=8), seed=7)
    tf.forward(list(range(7)))
    tf.forward([1])  # position 7: the last slot, fused
    assert tf.position == 8
    with pytest.raises(ContextOverflowError):
        tf.forward([2])
    assert tf.position == 8


def test_extension_checks_the_tuples_itself():
    p, caches, x, logits = decode_call()
    c = ckernels.EXT
    with pytest.raises(ValueError):
        c.decode(p.layers, tuple(caches[:-1]), p.head, x, logits, (1,), False)  # a cache missing
    with pytest.raises(ValueError):
        c.decode(p.layers, tuple(caches), p.head, x, logits[:-1], (1,), False)  # short logits
    with pytest.raises(ValueError):
        c.decode(p.layers, tuple(caches), p.head, x, logits, (64,), False)  # past the cache
    with pytest.raises(ValueError):
        c.decode(p.layers, tuple(caches), p.head, np.zeros(63, np.float32), logits, (1,), False)
    bad = list(p.layers[0])
    bad[7] = ((ckernels.F32, np.zeros((10, 64), np.float32), None, 10, 64, None),)  # wrong rows
    with pytest.raises(ValueError):
        c.decode((tuple(bad), *p.layers[1:]), tuple(caches), p.head, x, logits, (1,), False)
    c.decode(p.layers, tuple(caches), p.head, x, logits, (1,), False)  # the good call still works
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("scheme", ["float32", "gguf_q4_1", "loom_q4"])
def test_batched_rows_match_each_sequence_alone(scheme, monkeypatch, float_path):
    from poly.runtime.batch import forward_batch

    tf = random_transformer(tiny_cfg(), seed=9)
    if scheme != "float32":
        quantize_all(tf, scheme)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]  # rows at different positions
    states = [tf.new_state() for _ in prompts]
    forward_batch(tf, prompts, states)
    steps = [[20, 21, 22], [30, 31, 32], [40, 41, 42]]
    got = [forward_batch(tf, [[s[j]] for s in steps], states) for j in range(3)]  # fused rows
    with monkeypatch.context() as m:
        m.setattr(fused, "plan", lambda model: None)  # reference: each sequence on its own
        for b, prompt in enumerate(prompts):
            tf.reset()
            tf.forward(prompt)
            for j in range(3):
                ref = tf.forward([steps[b][j]])
                np.testing.assert_allclose(got[j][b], ref, atol=2e-5 * np.abs(ref).max())
    assert [st[0].length for st in states] == [6, 10, 4]


def test_more_rows_than_the_step_takes_use_the_python_path():
    tf = random_transformer(tiny_cfg(), seed=10)
    p = fused.plan(tf)
    states = [tf.new_state() for _ in range(ckernels.STEP_ROWS + 1)]
    x = np.zeros((ckernels.STEP_ROWS + 1, 64), np.float32)
    assert fused.step_rows(p, x, states) is None


def test_batched_rows_past_the_row_kernels_equal_each_row_alone(monkeypatch):
    """17 and 40 sequences in one step: the products run as gemm panels (or, with int8
    activations, in pieces of MAX_N rows); every row equals its own one-row step."""
    tf = random_transformer(tiny_cfg(), seed=12)
    p = fused.plan(tf)
    for n in (ckernels.MAX_N + 1, 40):
        x0 = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
        rows = fused.step_rows(p, x0.copy(), [tf.new_state() for _ in range(n)])
        assert rows is not None and rows.shape == (n, 120)
        for i in (0, n // 2, n - 1):
            alone = fused.step_rows(p, x0[i : i + 1].copy(), [tf.new_state()])
            np.testing.assert_allclose(rows[i], alone[0], rtol=0, atol=2e-5 * np.abs(alone).max())


@pytest.mark.parametrize("head_dim", [16, 24])  # 16-lane folds (AVX-512) and the 8-lane path
def test_attention_scores_in_blocks_of_eight_positions(head_dim, monkeypatch, each_isa):
    """Decode at positions past 8 and 40: the scores of 8 positions are reduced together
    (dot8x); the fused step equals the Python path on every ISA build, with a ragged tail."""
    tf = random_transformer(tiny_cfg(head_dim=head_dim, max_seq_len=128), seed=14)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 120, 37)]
    _assert_same(tf, monkeypatch, prompt=prompt)


def test_prompt_rows_compute_each_prompts_last_row_only(monkeypatch):
    """Prompts of 3, 1 and 5 tokens in one call: the LM head runs for their last rows only (the
    logits argument is (logits [3, V], rows)), and each equals the prompt run alone."""
    tf = random_transformer(tiny_cfg(), seed=13)
    p = fused.plan(tf)
    x0 = np.random.default_rng(3).standard_normal((9, 64)).astype(np.float32)
    seen = []
    real = ckernels.decode
    monkeypatch.setattr(ckernels, "decode", lambda *a: (seen.append(a), real(*a))[1])
    got = fused.prompt_rows(p, x0.copy(), [tf.new_state() for _ in range(3)], [3, 1, 5])
    assert got.shape == (3, 120) and seen[0][4][1] == (2, 3, 8)
    for b, (lo, hi) in enumerate([(0, 3), (3, 4), (4, 9)]):
        alone = fused.prompt_rows(p, x0[lo:hi].copy(), [tf.new_state()], [hi - lo])
        np.testing.assert_allclose(got[b], alone[0], rtol=0, atol=2e-5 * np.abs(alone).max())
    args = list(seen[0])
    for rows in ((3, 2), (0, 9), (), (-1,)):  # not ascending, past n, empty, negative
        args[3] = x0.copy()
        args[4] = (np.empty((max(len(rows), 1), 120), np.float32), rows)
        with pytest.raises(ValueError):
            real(*args)
    args[4] = (np.empty((3, 120), np.float32), (0, 1))  # 2 rows into a 3-row buffer
    with pytest.raises(ValueError):
        real(*args)


def test_rope_inplace_equals_numpy_rope():
    from poly.rope import apply_rope, rope_inplace, rope_tables

    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)  # [n, heads, hd]
    cos, sin = rope_tables(16, 10000.0, None, 32)
    ref = apply_rope(x, cos[7:12], sin[7:12])
    got = rope_inplace(x.copy(), cos, sin, 7)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        ckernels.EXT.rope(x.copy(), cos, sin, 30, 5, 16)  # positions past the tables
    with pytest.raises(ValueError):
        ckernels.EXT.rope(x.copy(), cos, sin, 0, 5, 15)  # odd head_dim


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_plain_half_arrays_are_read_directly(dtype, monkeypatch):
    """.entity f16/bf16 files install plain numpy half arrays (not QTensors) as versions."""
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    tf = random_transformer(tiny_cfg(), seed=12)
    for layer in tf.network.walk():
        if layer.type in (LayerType.MHA, LayerType.SWIGLU):
            comps = {
                name: None
                if view is None
                else np.ascontiguousarray(view).astype(
                    np_dtype if name in layout.MATRIX_COMPONENTS else np.float32
                )
                for name, view in layout.views(layer).items()
            }
            layer.weights.set_version(dtype, comps, activate=True)
    tf.lm_head = np.ascontiguousarray(tf.lm_head).astype(np_dtype)
    _assert_same(tf, monkeypatch, rtol=2e-5)


def test_non_float32_vectors_fall_back_to_the_python_path(monkeypatch):
    tf = random_transformer(tiny_cfg(), seed=13)
    norm = tf.attn_norm(1)
    gamma = np.array(layout.components(norm)["gamma"], dtype=np.float64)  # not what C reads
    norm.weights.set_version("f64", {"gamma": gamma}, activate=True)
    assert fused.plan(tf) is None
    out = tf.forward([1, 2])
    assert out.dtype == np.float32 and np.isfinite(out).all()


def test_silu_mul_matches_numpy_silu():
    from poly.ops import silu

    rng = np.random.default_rng(14)
    gu = (rng.standard_normal((4, 2 * 45)) * 12).astype(np.float32)  # odd width: SIMD + tail
    gu[0, 1], gu[1, 2], gu[2, 3], gu[3, 4] = np.nan, np.inf, -200.0, 200.0
    out = np.empty((4, 45), np.float32)
    ckernels.EXT.silu_mul(gu, out)
    ref = silu(gu[:, :45]) * gu[:, 45:]
    assert np.isnan(out[0, 1]) and out[1, 2] == ref[1, 2]
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-6, atol=1e-30)
    with pytest.raises(ValueError):
        ckernels.EXT.silu_mul(gu[:, :80].copy(), out)  # not [n, 2I]
    big = (rng.standard_normal((300, 2 * 301)) * 4).astype(np.float32)  # many rows: threads
    one = ckernels.silu_mul(big, np.empty((300, 301), np.float32))
    two = ckernels.silu_mul(big[:, :301].copy(), np.empty_like(one), big[:, 301:].copy())  # apart
    np.testing.assert_array_equal(two, one)
    with pytest.raises(ValueError):
        ckernels.EXT.silu_mul(big[:, :301].copy(), two, big[:5, 301:].copy())  # up not [n, I]


@pytest.mark.parametrize("head_dim", (64, 128, 24))  # the unrolled widths, and the scalar loop
def test_long_context_attention_matches_python_path(head_dim, monkeypatch, each_isa):
    cfg = tiny_cfg(
        hidden=128, inter=96, num_heads=2, num_kv_heads=1, head_dim=head_dim, max_seq_len=400
    )
    tf = random_transformer(cfg, seed=11)
    assert fused.plan(tf) is not None
    prompt = [(7 * i + 3) % 120 for i in range(300)]
    out = {}
    for use_fused in (False, True):
        with monkeypatch.context() as m:
            if not use_fused:
                m.setattr(fused, "plan", lambda model: None)
            tf.reset()
            tf.forward(prompt)
            out[use_fused] = [tf.forward([(5 * i + 1) % 120]) for i in range(3)]
    for r, g in zip(out[False], out[True]):
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * np.abs(r).max())


def test_int8_activation_rows_past_max_n_run_in_pieces():
    tf = random_transformer(tiny_cfg(hidden=128, inter=192), seed=13)
    quantize_all(tf, "gguf_q8_0")
    p = fused.plan(tf)
    old = ckernels.act_q8()
    ckernels.set_act_q8(True)  # no gemm panels: the row kernels, MAX_N rows at a time
    try:
        n = ckernels.MAX_N + 5
        x0 = np.random.default_rng(3).standard_normal((n, 128)).astype(np.float32)
        rows = fused.step_rows(p, x0.copy(), [tf.new_state() for _ in range(n)])
        for i in (0, ckernels.MAX_N, n - 1):
            alone = fused.step_rows(p, x0[i : i + 1].copy(), [tf.new_state()])
            np.testing.assert_allclose(rows[i], alone[0], rtol=0, atol=1e-6 * np.abs(alone).max())
    finally:
        ckernels.set_act_q8(old)
