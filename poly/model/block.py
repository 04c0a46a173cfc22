"""The pre-norm decoder block: build, slot names, the plain-block test and its reference run,
and the role -> shape table of a whole model derived from the poly.nn parameter specs."""

from __future__ import annotations

import numpy as np

from poly.config import TransformerConfig
from poly.layer import LayerType, VolumetricLayer
from poly.nn import mha, moe, rmsnorm, swiglu
from poly.nn.layout import spec
from poly.ops import rms_norm

# Sub-layer slots of one block: [RMSNorm, MHA, Residual(input), RMSNorm, SwiGLU, Residual(2)].
ATTN_NORM, ATTN, ATTN_RES, MLP_NORM, MLP, MLP_RES = range(6)
SLOT_NAMES = {ATTN_NORM: "attn_norm", ATTN: "attn", MLP_NORM: "mlp_norm", MLP: "mlp"}


def _mlp(cfg: TransformerConfig, allocate: bool, index: int) -> VolumetricLayer:
    """The block's FFN: a SwiGLU, or an MoE layer (poly.nn.moe) in the sparse layers."""
    if cfg.moe is not None and index not in cfg.moe.dense_layers:
        return VolumetricLayer(
            type=LayerType.MOE, input_height=cfg.hidden_size, moe=cfg.moe, allocate=allocate
        )
    return VolumetricLayer(
        type=LayerType.SWIGLU,
        input_height=cfg.hidden_size,
        output_height=cfg.intermediate_size,
        allocate=allocate,
    )


def build_block(cfg: TransformerConfig, allocate: bool = True, index: int = 0) -> VolumetricLayer:
    """One pre-norm decoder block as a Sequential layer of six sub-layers (block `index`: its FFN
    is an MoE layer when the config has experts and `index` is not one of its dense layers)."""
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    subs = [
        VolumetricLayer(
            type=LayerType.RMSNORM, input_height=h, rms_norm_eps=eps, allocate=allocate
        ),
        VolumetricLayer(
            type=LayerType.MHA,
            d_model=h,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            query_dim=cfg.query_dim,
            max_seq_len=cfg.max_seq_len,
            rope_freq_base=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            rms_norm_eps=eps,
            qk_norm=cfg.qk_norm,
            allocate=allocate,
        ),
        VolumetricLayer(type=LayerType.RESIDUAL, skip="input"),
        VolumetricLayer(
            type=LayerType.RMSNORM, input_height=h, rms_norm_eps=eps, allocate=allocate
        ),
        _mlp(cfg, allocate, index),
        VolumetricLayer(type=LayerType.RESIDUAL, skip=ATTN_RES),
    ]
    return VolumetricLayer(type=LayerType.SEQUENTIAL, sequential_layers=subs)


def param_shapes(cfg: TransformerConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """role -> shape per part of one model, from the poly.nn specs: {"attn_norm": {"gamma":
    (h,)}, "attn": {"w_q": (q, h), ...}, "mlp_norm": ..., "mlp": ..., "embeddings": {"w": (V, h)},
    "lm_head": {"w": (V, h)}, "final_norm": {"gamma": (h,)}}. Every block has the same shapes."""
    blk = build_block(cfg, allocate=False)
    out = {name: dict(spec(blk.sequential_layers[slot])) for slot, name in SLOT_NAMES.items()}
    table = (cfg.vocab_size, cfg.hidden_size)
    out.update(embeddings={"w": table}, lm_head={"w": table}, final_norm={"gamma": table[1:]})
    return out


_BLOCK_KINDS = (
    LayerType.RMSNORM,
    LayerType.MHA,
    LayerType.RESIDUAL,
    LayerType.RMSNORM,
    LayerType.SWIGLU,
    LayerType.RESIDUAL,
)


_FFN_FORWARD = {LayerType.SWIGLU: swiglu.forward, LayerType.MOE: moe.forward}


def is_plain_block(blk: VolumetricLayer) -> bool:
    """The block `build_block` makes, untiled and fully enabled: it can skip generic dispatch.
    Its FFN is a SwiGLU or an MoE layer."""
    subs = blk.sequential_layers
    return (
        len(subs) == 6
        and all(
            (s.type == k or (i == MLP and s.type == LayerType.MOE))
            and not s.is_disabled
            and not s.use_tiling
            for i, (s, k) in enumerate(zip(subs, _BLOCK_KINDS))
        )
        and subs[ATTN_RES].skip == "input"
        and subs[MLP_RES].skip == ATTN_RES
    )


def run_block(
    blk: VolumetricLayer, x: np.ndarray, caches: list | None = None, bounds=None, rows=None
) -> np.ndarray:
    """x + attn(norm(x)), then + mlp(norm(.)): the plain block without per-sub-layer dispatch.
    With `caches` the rows are several sequences: segment b (rows `bounds[b]`, default row b)
    continues caches[b] (`mha.forward_rows`). `rows` (an index): only those rows go on through
    the FFN and are returned (every row attends and is cached)."""
    subs = blk.sequential_layers
    norm1, attn, norm2, mlp = subs[ATTN_NORM], subs[ATTN], subs[MLP_NORM], subs[MLP]
    h = rms_norm(x, rmsnorm.gamma(norm1), norm1.rms_norm_eps)
    a = mha.forward(attn, h) if caches is None else mha.forward_rows(attn, h, caches, bounds)
    x = x + a if rows is None else x[rows] + a[rows]  # [n or len(rows), H]
    h = rms_norm(x, rmsnorm.gamma(norm2), norm2.rms_norm_eps)
    x += _FFN_FORWARD[mlp.type](mlp, h)
    return x
