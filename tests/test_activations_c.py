"""The fused step's element-wise activations (csrc/core/activations.h, on 8 lanes in the SIMD
builds) against torch: GeGLU's tanh GELU, the soft-cap's tanh, GPT-OSS's clamped SwiGLU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _inputs() -> np.ndarray:
    """A dense grid over [-12, 12], random values at many scales, and large |x| (float32)."""
    rng = np.random.default_rng(0)
    grid = np.linspace(-12, 12, 24_001)
    scaled = rng.standard_normal(4_000) * 10.0 ** rng.uniform(-8, 4, 4_000)
    big = np.array([-1e30, -1e4, -100, -88.5, -30, -10.01, 10.01, 30, 88.5, 100, 1e4, 1e30])
    tiny = np.array([0.0, -0.0, 1e-38, -1e-38, 1e-20, -1e-20])
    return np.concatenate([grid, scaled, big, tiny]).astype(np.float32)


def _act(kind: int, g: np.ndarray, u=None, alpha=0.0, limit=0.0) -> np.ndarray:
    from poly.runtime import ckernels

    out = np.empty_like(g)
    ckernels.EXT.act(kind, g, u, out, alpha, limit)
    return out


def _err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - ref)


def _gelu64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """torch's tanh GELU in float64 as x * sigmoid(2u) (the same function; torch's own
    0.5 x (1 + tanh u) cancels in float64 too below x ~ -6), and |2u|."""
    t = torch.from_numpy(x).double()
    a = np.sqrt(8 / np.pi) * (t + 0.044715 * t**3)
    ref = (t * torch.sigmoid(a)).numpy()
    live = x > -3
    want = F.gelu(t, approximate="tanh").numpy()[live]
    assert np.all(np.abs(ref[live] - want) <= 1e-12 * np.abs(want))  # it is torch's function
    return ref, np.abs(a.numpy())


def test_gelu_tanh_within_1e6_of_torch_float64(each_isa):
    """Where GELU is not vanishing (x >= -2.5: |gelu| >= 1.5e-2) within 1e-6 relative of
    torch's float64 values; below, within the float32 input's own conditioning (one ulp of x
    moves gelu by ~|2u| ulps: 2e-7 |2u| relative; torch's float32 gelu is 30 % off at x = -5
    and 0 from -7 on) and float32's underflow."""
    x = _inputs()
    ref, a = _gelu64(x)
    for got in (_act(3, x), _act(1, x, np.ones_like(x))):
        err = _err(got, ref)
        live = x >= -2.5
        assert np.all(err[live] <= 1e-6 * np.abs(ref[live]))
        assert np.all(err <= 2e-7 * np.maximum(a, 1) * np.abs(ref) + 1e-37)
    assert _act(3, np.array([np.nan, np.inf, -np.inf], np.float32)).tolist()[1] == np.inf
    assert np.isnan(_act(3, np.array([np.nan] * 9, np.float32))).all()  # vector lanes and tail


def test_geglu_multiplies_by_up(each_isa):
    rng = np.random.default_rng(1)
    g, u = (rng.standard_normal(1_003).astype(np.float32) * 3 for _ in range(2))
    ref, a = _gelu64(g)
    ref = ref * u
    got = _act(1, g, u)
    assert np.all(_err(got, ref) <= 2e-7 * np.maximum(a, 5) * np.abs(ref) + 1e-37)


def test_softcap_tanh_within_1e6_of_torch_float64(each_isa):
    x = _inputs()
    ref = torch.tanh(torch.from_numpy(x).double()).numpy()
    got = _act(4, x)
    nz = ref != 0
    assert np.all(_err(got, ref)[nz] <= 1e-6 * np.abs(ref[nz]))
    assert np.array_equal(got[~nz], ref[~nz])
    assert np.isnan(_act(4, np.full(11, np.nan, np.float32))).all()


def test_clamped_swiglu_matches_torch(each_isa):
    """GPT-OSS's expert activation (transformers GptOssExperts: gate clamped above at limit, up
    to +-limit, (up + 1) * gate * sigmoid(alpha * gate)) against torch in float64."""
    rng = np.random.default_rng(2)
    g = np.concatenate([rng.standard_normal(2_000) * 8, [-1e4, -200, 7.0, 7.5, 1e4, 0.0]])
    u = np.concatenate([rng.standard_normal(2_000) * 8, [1e4, -1e4, -7.5, 8.0, 3.0, 1.0]])
    g, u = g.astype(np.float32), u.astype(np.float32)
    alpha, limit = 1.702, 7.0
    tg, tu = torch.from_numpy(g).double().clamp(max=limit), torch.from_numpy(u).double()
    ref = ((tu.clamp(-limit, limit) + 1) * tg * torch.sigmoid(alpha * tg)).numpy()
    got = _act(5, g, u, alpha, limit)
    # 1e-6 relative, or where sigmoid's argument is large its conditioning (as GELU's above)
    ag = np.abs(alpha * np.minimum(g, limit))
    assert np.all(_err(got, ref) <= np.maximum(1e-6, 2e-7 * ag) * np.abs(ref) + 1e-37)
    g[3], u[5] = np.nan, np.nan
    got = _act(5, g, u, alpha, limit)
    assert np.isnan(got[3]) and np.isnan(got[5]) and np.isfinite(got[:3]).all()


def test_act_rejects_bad_arguments():
    from poly.runtime import ckernels

    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        ckernels.EXT.act(1, x, None, x.copy(), 0.0, 0.0)  # GeGLU needs up
    with pytest.raises(ValueError):
        ckernels.EXT.act(3, x, np.zeros(4, np.float32), x.copy(), 0.0, 0.0)
    with pytest.raises(ValueError):
        ckernels.EXT.act(1, x, np.zeros(4, np.float32), x.copy(), 0.0, 0.0)  # lengths differ
