"""A random tiny poly.Transformer for tests that need a real model but no checkpoint."""

import numpy as np

from poly import LayerType, Transformer, TransformerConfig


def random_transformer(
    cfg: TransformerConfig,
    seed: int = 0,
    *,
    master_scale: float = 0.2,
    master_mean: float = 0.0,
    norm_shift: float = 0.0,
    embed_scale: float = 1.0,
    head_scale: float | None = 0.3,
    final_norm_scale: float | None = 0.1,
) -> Transformer:
    """Every layer master ~N(master_mean, master_scale), embeddings ~N(0, embed_scale), LM head
    ~N(0, head_scale), final norm ~N(1, final_norm_scale); by default ~N(0, 0.2), ~N(0, 1),
    ~N(0, 0.3), ~1.

    One generator draws them in that order (masters in `network.walk()` order), so a test whose
    numbers were set with its own fill keeps them by passing that fill's scales. ``norm_shift``
    is added to the RMSNorm gammas after their draw (1.0: gammas near 1). A None scale skips its
    draw and keeps `from_config`'s value: the LM head of a tied model is the embeddings table,
    the final norm is 1.
    """
    tf = Transformer.from_config(cfg)
    rng = np.random.default_rng(seed)
    for layer in tf.network.walk():
        if layer.weights is not None and layer.weights.size:
            master = layer.weights.master
            master[:] = rng.standard_normal(layer.weights.size) * master_scale + master_mean
            if norm_shift and layer.type == LayerType.RMSNORM:
                master[:] += norm_shift  # in float32 after the draw: the rounding tests expect
    tf.embeddings[...] = rng.standard_normal(tf.embeddings.shape) * embed_scale
    if head_scale is not None:
        tf.lm_head[...] = rng.standard_normal(tf.lm_head.shape) * head_scale
    if final_norm_scale is not None:
        tf.final_norm = 1.0 + final_norm_scale * rng.standard_normal(cfg.hidden_size)
    return tf


def tiny_cfg(hidden=64, inter=96, **kw) -> TransformerConfig:
    base = dict(vocab_size=120, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=64)
    base.update(kw)
    return TransformerConfig(hidden_size=hidden, intermediate_size=inter, **base)


def decode_call(seed: int = 8):
    """(plan, caches, x, logits) of a direct ckernels.decode call on a tiny model at position 1."""
    from poly.runtime import fused

    tf = random_transformer(tiny_cfg(), seed=seed)
    tf.forward([1])
    p = fused.plan(tf)
    caches = []
    for layer in p.attn:
        caches += (layer.state.k, layer.state.v)
    return p, caches, np.zeros(64, np.float32), np.empty(p.vocab, np.float32)
