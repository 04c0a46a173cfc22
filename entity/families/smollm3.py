"""smollm3 (SmolLM3): llama's block with NoPE layers: `no_rope_layers[i]` 0 means layer i has no
rotary embedding (default: every `no_rope_layer_interval`-th layer, transformers' rule)."""

from entity.families.base import Family
from poly.errors import LayerConfigError


def _options(cfg) -> dict:
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        if type(every) is not int or every <= 0:
            raise LayerConfigError(
                f"no_rope_layer_interval must be a positive integer, got {every!r}"
            )
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise LayerConfigError(f"no_rope_layers must list 0 or 1 for each of the {n} layers")
    if cfg.get("use_sliding_window"):  # transformers slides the NoPE layers: not read yet
        raise LayerConfigError("use_sliding_window is not supported for smollm3")
    return {"attention": {"nope_layers": [i for i, f in enumerate(flags) if not f]}}


FAMILY = Family(
    model_type="smollm3",
    causal_lm_class="SmolLM3ForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=32768,
    sliding="none",
    hf_options=_options,
)
