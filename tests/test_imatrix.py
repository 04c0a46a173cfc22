"""The importance matrix (poly.model.imatrix) against transformers: per nn.Linear, the mean of the
squared inputs over the calibration tokens, hooked on the inputs of the torch modules."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_fixtures import cached_hf_model, make_tiny_checkpoint

# transformers module path -> .entity blob name (layer i substituted)
_NAMES = {
    "self_attn.q_proj": "attn.w_q",
    "self_attn.k_proj": "attn.w_k",
    "self_attn.v_proj": "attn.w_v",
    "self_attn.o_proj": "attn.w_o",
    "mlp.gate_proj": "mlp.w_gate",
    "mlp.up_proj": "mlp.w_up",
    "mlp.down_proj": "mlp.w_down",
}
CHUNKS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]]


def _torch_imatrix(model_dir) -> dict[str, np.ndarray]:
    import torch

    model = cached_hf_model(str(model_dir))
    sums: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}
    hooks = []
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if path == "lm_head":
            name = "lm_head" if not model.config.tie_word_embeddings else "embeddings"
        else:
            i, rest = path.split(".", 3)[2], path.split(".", 3)[3]
            name = f"blocks.{i}.{_NAMES[rest]}"

        def hook(mod, args, name=name):
            x = args[0].detach().double().reshape(-1, args[0].shape[-1]).numpy()
            sums[name] = sums.get(name, 0) + (x * x).sum(axis=0)
            rows[name] = rows.get(name, 0) + x.shape[0]

        hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in CHUNKS:
                model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {n: sums[n] / rows[n] for n in sums}


@pytest.mark.parametrize("tied", [False, True])
def test_imatrix_equals_transformers_linear_inputs(tmp_path, tied):
    from entity import load
    from poly.model.imatrix import collect

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama", tied=tied, seed=3)
    ref = _torch_imatrix(model_dir)
    got = collect(load(model_dir), CHUNKS, total=len(CHUNKS))
    assert set(got) == set(ref)  # every linear, the LM head included (tied: the embeddings)
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=2e-4, atol=1e-6, err_msg=name)
