"""The decoder block built from its recipe (poly.recipe.BlockRecipe): build, slot names, the
check that a block is still the one built, its reference run, and the role -> shape table of a
whole model derived from the poly.nn parameter specs."""

from __future__ import annotations

import functools

import numpy as np

from poly.config import TransformerConfig
from poly.errors import LayerConfigError
from poly.layer import Activation, LayerType, VolumetricLayer, kind_of
from poly.nn import mha, moe, rmsnorm, swiglu
from poly.nn.layout import spec
from poly.ops import rms_norm
from poly.recipe import PLAIN_BLOCK, AttentionConfig, BlockRecipe

# Sub-layer slots of llama's block: [RMSNorm, MHA, Residual(input), RMSNorm, SwiGLU, Residual(2)].
ATTN_NORM, ATTN, ATTN_RES, MLP_NORM, MLP, MLP_RES = range(6)
SLOT_NAMES = {ATTN_NORM: "attn_norm", ATTN: "attn", MLP_NORM: "mlp_norm", MLP: "mlp"}

# Sub-layer roles in order per wiring; "*_res" are Residual layers (no weights). The generic
# Sequential forward runs the first two; a parallel block runs only through `run_block`.
PRE_NORM = ("attn_norm", "attn", "attn_res", "mlp_norm", "mlp", "mlp_res")
SANDWICH = ("attn_norm", "attn", "attn_post_norm", "attn_res",
            "mlp_norm", "mlp", "mlp_post_norm", "mlp_res")  # fmt: skip
POST_ONLY = ("attn", "attn_post_norm", "attn_res", "mlp", "mlp_post_norm", "mlp_res")  # OLMo 2
PARALLEL = ("attn_norm", "attn", "mlp_norm", "mlp", "res")
PARALLEL_SHARED = ("attn_norm", "attn", "mlp", "res")
NORM_ROLES = frozenset({"attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"})

# Layer kind per recipe name: norms, and the FFN as (kind, activation). LayerNorm and the plain
# GELU MLP register their kinds here (poly.nn.layernorm, poly.nn.gelu_mlp).
NORM_LAYERS: dict[str, LayerType] = {
    "rms": LayerType.RMSNORM,
    "layernorm": LayerType.LAYERNORM,  # beta loaded from the file
    "layernorm_nobias": LayerType.LAYERNORM,  # beta stays zero (Cohere)
}
FFN_LAYERS: dict[str, tuple[LayerType, Activation]] = {
    "swiglu": (LayerType.SWIGLU, Activation.SILU),
    "geglu": (LayerType.SWIGLU, Activation.GELU),  # poly.ops GELU is the tanh form
    "gelu_mlp": (LayerType.GELU_MLP, Activation.GELU_ERF),  # HF "gelu" (GPT-NeoX)
    "gelu_tanh_mlp": (LayerType.GELU_MLP, Activation.GELU),  # gelu_new / gelu_pytorch_tanh
}


@functools.lru_cache(maxsize=16)
def layout(recipe: BlockRecipe) -> tuple[str, ...]:
    """The block's sub-layer roles in order."""
    if recipe.parallel:
        return PARALLEL_SHARED if recipe.shared_norm else PARALLEL
    if recipe.post_norms:
        return SANDWICH if recipe.pre_norms else POST_ONLY
    return PRE_NORM


@functools.lru_cache(maxsize=16)
def slots(recipe: BlockRecipe) -> dict[str, int]:
    """role -> sub-layer index."""
    return {role: i for i, role in enumerate(layout(recipe))}


def weight_roles(recipe: BlockRecipe) -> tuple[str, ...]:
    """The roles that hold weights, in block order (entity's per-block tensor groups)."""
    return tuple(r for r in layout(recipe) if not r.endswith("res"))


def norm_layer(cfg: TransformerConfig, allocate: bool = True) -> VolumetricLayer:
    """One norm of the model's kind (the blocks' and the final norm)."""
    kind = NORM_LAYERS.get(cfg.block.norm)
    if kind is None:
        raise LayerConfigError(f"block.norm {cfg.block.norm!r} has no layer kind")
    return VolumetricLayer(
        type=kind, input_height=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps, allocate=allocate
    )


def _mlp(cfg: TransformerConfig, allocate: bool, index: int) -> VolumetricLayer:
    """The block's FFN: the recipe's kind, or an MoE layer (poly.nn.moe) in the sparse layers."""
    if cfg.moe is not None and index not in cfg.moe.dense_layers:
        return VolumetricLayer(
            type=LayerType.MOE, input_height=cfg.hidden_size, moe=cfg.moe, allocate=allocate
        )
    kind = FFN_LAYERS.get(cfg.block.ffn)
    if kind is None:
        raise LayerConfigError(f"block.ffn {cfg.block.ffn!r} has no layer kind")
    return VolumetricLayer(
        type=kind[0],
        activation=kind[1],
        input_height=cfg.hidden_size,
        output_height=cfg.intermediate_size,
        allocate=allocate,
    )


def _attn(cfg: TransformerConfig, allocate: bool, index: int) -> VolumetricLayer:
    opts = cfg.attention or AttentionConfig()  # layer `index`'s attention options
    rot = opts.rotary_dim(cfg.head_dim, index)
    local = opts.local_rope_theta if opts.window_of(index) else None  # gemma3's local layers
    return VolumetricLayer(
        type=LayerType.MHA,
        sliding_window=opts.window_of(index),
        rotary_dim=rot,
        use_rope=rot > 0,
        rope_interleaved=opts.rope_interleaved,
        qk_norm_all=opts.qk_norm_all,
        qk_norm_kind=opts.qk_norm_kind,
        qk_norm_heads=opts.qk_norm_heads,
        attn_scale=opts.scale or 0.0,
        attn_softcap=opts.softcap or 0.0,
        attn_sinks=opts.sinks,
        d_model=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        query_dim=cfg.query_dim,
        max_seq_len=cfg.max_seq_len,
        rope_freq_base=local or cfg.rope_theta,
        rope_scaling=None if local else cfg.rope_scaling,
        rms_norm_eps=cfg.rms_norm_eps,
        qk_norm=cfg.qk_norm,
        allocate=allocate,
    )


def build_block(cfg: TransformerConfig, allocate: bool = True, index: int = 0) -> VolumetricLayer:
    """Block `index` as a Sequential layer of the recipe's sub-layers (`layout`); its FFN is an
    MoE layer when the config has experts and `index` is not one of its dense layers."""
    roles = layout(cfg.block)
    subs = []
    for role in roles:
        if role in NORM_ROLES:
            subs.append(norm_layer(cfg, allocate))
        elif role == "attn":
            subs.append(_attn(cfg, allocate, index))
        elif role == "mlp":
            subs.append(_mlp(cfg, allocate, index))
        else:  # the attention branch adds the block input, the FFN's the attention sum
            skip = roles.index("attn_res") if role == "mlp_res" else "input"
            subs.append(VolumetricLayer(type=LayerType.RESIDUAL, skip=skip))
    return VolumetricLayer(type=LayerType.SEQUENTIAL, sequential_layers=subs)


def param_shapes(cfg: TransformerConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """role -> shape per part of one model, from the poly.nn specs: {"attn_norm": {"gamma":
    (h,)}, "attn": {"w_q": (q, h), ...}, "mlp_norm": ..., "mlp": ..., "embeddings": {"w": (V, h)},
    "lm_head": {"w": (V, h)}, "final_norm": {"gamma": (h,)}}. Every block has the same shapes."""
    blk = build_block(cfg, allocate=False)
    roles = layout(cfg.block)
    out = {r: dict(spec(blk.sequential_layers[roles.index(r)])) for r in weight_roles(cfg.block)}
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


def is_plain_block(blk: VolumetricLayer) -> bool:
    """llama's block as `build_block` makes it, untiled and fully enabled (the fused C step's and
    tensor parallelism's). Its FFN is a SwiGLU or an MoE layer."""
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


def is_recipe_block(blk: VolumetricLayer, recipe: BlockRecipe) -> bool:
    """The block `build_block` made for `recipe`, untiled and fully enabled: `run_block` runs it
    (an edited one runs through the generic Sequential forward)."""
    if recipe == PLAIN_BLOCK:
        return is_plain_block(blk)
    subs, roles = blk.sequential_layers, layout(recipe)
    return (
        len(subs) == len(roles)
        and all(not s.is_disabled and not s.use_tiling for s in subs)
        and all((s.type == LayerType.RESIDUAL) == r.endswith("res") for s, r in zip(subs, roles))
        and all((s.type == LayerType.MHA) == (r == "attn") for s, r in zip(subs, roles))
    )


def _norm(layer: VolumetricLayer, x: np.ndarray) -> np.ndarray:
    if layer.type == LayerType.RMSNORM:
        return rms_norm(x, rmsnorm.gamma(layer), layer.rms_norm_eps)
    return kind_of(layer.type).forward(layer, x, None)


def _ffn(layer: VolumetricLayer, h: np.ndarray) -> np.ndarray:
    if layer.type == LayerType.SWIGLU:
        return swiglu.forward(layer, h)
    if layer.type == LayerType.MOE:
        return moe.forward(layer, h)
    return kind_of(layer.type).forward(layer, h, None)


def run_block(
    blk: VolumetricLayer,
    x: np.ndarray,
    caches: list | None = None,
    bounds=None,
    rows=None,
    cfg: TransformerConfig | None = None,
    reduce=None,
) -> np.ndarray:
    """The block without per-sub-layer dispatch: x + attn(norm(x)), then + mlp(norm(.)) for
    llama's block, else as `cfg.block` wires it. With `caches` the rows are several sequences:
    segment b (rows `bounds[b]`, default row b) continues caches[b] (`mha.forward_rows`).
    `rows` (an index): only those rows go on through the FFN and are returned (every row
    attends and is cached). `reduce` (tensor parallelism): the sum over ranks of a branch's
    partial output, applied before anything that needs the whole of it (post-norms)."""
    recipe = PLAIN_BLOCK if cfg is None else cfg.block
    mult = 1.0 if cfg is None else cfg.residual_multiplier
    total = reduce or (lambda v: v)
    subs, at = blk.sequential_layers, slots(recipe)
    h = _norm(subs[at["attn_norm"]], x) if recipe.pre_norms else x
    attn = subs[at["attn"]]
    a = mha.forward(attn, h) if caches is None else mha.forward_rows(attn, h, caches, bounds)
    keep = slice(None) if rows is None else rows
    if recipe.parallel:
        m_in = h if recipe.shared_norm else _norm(subs[at["mlp_norm"]], x)
        branch = total(a[keep] + _ffn(subs[at["mlp"]], m_in[keep]))
        return x[keep] + (branch if mult == 1 else branch * np.asarray(mult, x.dtype))
    a = total(a)
    if recipe.post_norms:
        a = _norm(subs[at["attn_post_norm"]], a)
    x = x[keep] + (a[keep] if mult == 1 else a[keep] * np.asarray(mult, x.dtype))
    m = total(_ffn(subs[at["mlp"]], _norm(subs[at["mlp_norm"]], x) if recipe.pre_norms else x))
    if recipe.post_norms:
        m = _norm(subs[at["mlp_post_norm"]], m)
    x += m if mult == 1 else m * np.asarray(mult, x.dtype)
    return x
