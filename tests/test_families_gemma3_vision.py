"""Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration, model_type "gemma3": 4B-27B)
load as their text model: the nested `text_config` is read as gemma3_text's config, the
`language_model.` tensors are mapped, the vision tower and projector dropped. Against
transformers' own Gemma3ForConditionalGeneration on text-only input (eager attention, float32):
logits at every position within 1e-4, 32 greedy tokens equal with and without the KV cache;
llama.cpp's converter (which writes the text model of such a checkpoint) likewise. A config
without its text_config is a one-line error naming the key."""

from __future__ import annotations

import copy
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import entity
from poly.errors import ConfigError
from tests.family_helpers import assert_entity_f32_exact, assert_load_error, converter_root
from tests.hf_fixtures import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    SPECIALS,
    VOCAB,
    build_tokenizer,
    randomize_norms_and_biases,
)
from tests.test_moe_hf import greedy

N_NEW = 32
PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180, 222, 9, 150, 260]
IMAGE_TOKEN = VOCAB - 1  # never in PROMPT: text-only input
# five sliding layers to one global would need 6 layers: 3 layers, windows of 6, the middle global
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 20,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": 0,
}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip


def _build(out: Path, seed: int, **text) -> Path:
    """A tiny Gemma3ForConditionalGeneration; `text` overrides TEXT's keys (None drops one)."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    text = {k: v for k, v in {**TEXT, **text}.items() if v is not None}
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=VISION, mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
        tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    randomize_norms_and_biases(model, seed)
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID,
                                                            eos_token_id=EOS_ID)  # fmt: skip
    model.save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), bos_token=SPECIALS[0], eos_token=SPECIALS[2],
        pad_token=SPECIALS[0], chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)  # fmt: skip
    return out


@functools.lru_cache(maxsize=2)
def _reference(path: str):
    import torch
    import transformers

    torch.set_num_threads(1)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = _reference(str(path))(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def _hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    import torch

    model = _reference(str(path))
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = [], 0, False
    gc.max_new_tokens, gc.min_new_tokens = n, None
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), generation_config=gc,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
    return seq[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("gemma3_mm") / "hf", seed=31)


def test_the_checkpoint_is_multimodal(ckpt):
    """What the import has to cope with: the nested config and the vision tower's tensors."""
    from safetensors import safe_open

    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "gemma3" and "text_config" in config
    with safe_open(str(ckpt / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)


def test_text_logits_and_greedy_match_transformers(ckpt):
    tf = entity.load(ckpt)
    assert tf.config.architecture == "gemma3_text" and tf.config.qk_norm
    assert tf.attn(0).sliding_window == 6 and tf.attn(1).sliding_window == 0
    np.testing.assert_allclose(tf.forward_all(PROMPT), _hf_logits(ckpt, PROMPT), atol=1e-4, rtol=0)
    want = _hf_greedy(ckpt, PROMPT, N_NEW)
    assert greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(tf, PROMPT, N_NEW, use_cache=False) == want


def test_entity_f32_is_exact(ckpt, tmp_path):
    assert_entity_f32_exact(ckpt, tmp_path, PROMPT)


def test_a_missing_text_config_names_the_key(ckpt, tmp_path):
    path = Path(shutil.copytree(ckpt, tmp_path / "m"))
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]
    (path / "config.json").write_text(json.dumps(config))
    assert_load_error(path, ConfigError, "text_config")


@pytest.mark.slow
def test_gguf_from_llama_cpp_matches_transformers(tmp_path):
    """llama.cpp's gemma3 files carry neither layer_types nor query_pre_attn_scalar: a config it
    represents has five sliding layers to one global and a scalar of head_dim."""
    from benchmarks import llama_convert

    root = converter_root()
    six = {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 24}
    ckpt = _build(tmp_path / "hf", seed=32, **six)
    f32 = entity.load(llama_convert.convert(ckpt, tmp_path / "g3.f32.gguf", "f32", root))
    np.testing.assert_allclose(f32.forward_all(PROMPT), _hf_logits(ckpt, PROMPT), atol=1e-4, rtol=0)
    want = _hf_greedy(ckpt, PROMPT, N_NEW)
    assert greedy(f32, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(f32, PROMPT, N_NEW, use_cache=False) == want
