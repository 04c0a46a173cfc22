"""A random tiny poly.Transformer for tests that need a real model but no checkpoint."""

import numpy as np

from poly import Transformer, TransformerConfig


def random_transformer(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    """Every layer master ~N(0, 0.2), embeddings ~N(0, 1), LM head ~N(0, 0.3), final norm ~1."""
    tf = Transformer.from_config(cfg)
    rng = np.random.default_rng(seed)
    for layer in tf.network.walk():
        if layer.weights is not None and layer.weights.size:
            layer.weights.master[:] = rng.standard_normal(layer.weights.size) * 0.2
    tf.embeddings[...] = rng.standard_normal(tf.embeddings.shape)
    tf.lm_head[...] = rng.standard_normal(tf.lm_head.shape) * 0.3
    tf.final_norm = 1.0 + 0.1 * rng.standard_normal(cfg.hidden_size)
    return tf
