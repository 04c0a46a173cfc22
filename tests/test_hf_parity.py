"""Acceptance: HF checkpoints load with exact parity against transformers (torch CPU).

Reference numbers come from transformers itself (tests/hf_fixtures.py builds each tiny
checkpoint with transformers and runs it); nothing expected here is of our own making.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import entity
from entity.hf import iter_hf_blocks, load_hf
from entity.hf.config import load_hf_config
from poly.errors import (
    ConfigError,
    EntityFormatError,
    FormatError,
    GGUFFormatError,
    IntegrityError,
    ModelNotFoundError,
    UnsafeFormatError,
    UnsupportedError,
    WeightMappingError,
)
from poly.nn import layout
from tests.hf_fixtures import (
    ARCHS,
    VOCAB,
    hf_greedy,
    hf_logits,
    make_tiny_checkpoint,
    set_config_keys,
)

PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180, 222, 9, 150, 299]
N_NEW = 32
VARIANTS = [(a, d, t) for a in ARCHS for d in ("float32", "bfloat16") for t in (False, True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str, bool], Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        v: make_tiny_checkpoint(root / "-".join(map(str, v)), v[0], dtype=v[1], tied=v[2], seed=i)
        for i, v in enumerate(VARIANTS)
    }


def _greedy_ours(tf, ids: list[int], n: int, use_cache: bool) -> list[int]:
    tf.reset()
    out: list[int] = []
    logits = tf.forward(ids)
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        if use_cache:
            logits = tf.forward([tok])  # incremental decode on the KV cache
        else:
            tf.reset()
            logits = tf.forward(ids + out)  # re-run the whole prefix
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_logits_and_greedy_match_transformers(checkpoints, variant):
    path = checkpoints[variant]
    tf = entity.load(path)
    assert tf.tied == variant[2]
    ours = tf.forward_all(PROMPT)
    ref = hf_logits(path, PROMPT)
    assert ours.dtype == np.float32 and ours.shape == (len(PROMPT), VOCAB)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    want = hf_greedy(path, PROMPT, N_NEW, use_cache=True)
    if not variant[2]:  # transformers' own cache/no-cache agreement, once per arch and dtype
        assert want == hf_greedy(path, PROMPT, N_NEW, use_cache=False)
    assert _greedy_ours(tf, PROMPT, N_NEW, use_cache=True) == want
    assert _greedy_ours(tf, PROMPT, N_NEW, use_cache=False) == want


def test_prefill_in_one_call_equals_token_by_token(checkpoints):
    tf = load_hf(checkpoints[("qwen2", "float32", False)])
    whole = tf.forward_all(PROMPT)
    tf.reset()
    steps = np.stack([tf.forward([t]) for t in PROMPT])
    # one-token steps run the fused C step (poly/runtime/fused.py): its sums are ordered differently
    np.testing.assert_allclose(steps, whole, atol=5e-5, rtol=0)


def test_weights_land_in_the_right_slots(checkpoints):
    # Compare against the safetensors library's own reader: biases in bias slots, q/k norms kept.
    for arch in ("qwen2", "qwen3"):
        path = checkpoints[(arch, "float32", False)]
        tf = load_hf(path)
        ref = load_file(str(path / "model.safetensors"))
        views = layout.mha(tf.attn(1))
        np.testing.assert_array_equal(views.w_q, ref["model.layers.1.self_attn.q_proj.weight"])
        np.testing.assert_array_equal(views.w_o, ref["model.layers.1.self_attn.o_proj.weight"])
        if arch == "qwen2":
            b = ref["model.layers.1.self_attn.k_proj.bias"]
            assert np.abs(b).max() > 0
            np.testing.assert_array_equal(views.b_k, b)
            assert not views.b_o.any()  # qwen2 has no o_proj bias
        else:
            np.testing.assert_array_equal(
                views.k_norm, ref["model.layers.1.self_attn.k_norm.weight"]
            )
        mlp = layout.swiglu(tf.mlp(0))
        np.testing.assert_array_equal(mlp.w_down, ref["model.layers.0.mlp.down_proj.weight"])
        np.testing.assert_array_equal(tf.final_norm, ref["model.norm.weight"])


def test_two_shards_load_bitwise_equal(tmp_path, checkpoints):
    single = checkpoints[("qwen3", "bfloat16", False)]
    sharded = make_tiny_checkpoint(
        tmp_path / "sharded",
        "qwen3",
        dtype="bfloat16",
        tied=False,
        seed=VARIANTS.index(("qwen3", "bfloat16", False)),
        shards=2,
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) >= 2
    a, b = load_hf(single), load_hf(sharded)
    for (ia, pa), (ib, pb) in zip(iter_hf_blocks(single), iter_hf_blocks(sharded), strict=True):
        assert ia == ib and pa.keys() == pb.keys()
    for i in range(a.config.num_layers):
        for get in ("attn_norm", "attn", "mlp_norm", "mlp"):
            ma, mb = getattr(a, get)(i).weights.master, getattr(b, get)(i).weights.master
            assert ma.tobytes() == mb.tobytes()
    assert a.embeddings.tobytes() == b.embeddings.tobytes()
    assert a.lm_head.tobytes() == b.lm_head.tobytes()


def test_iter_hf_blocks_layout(checkpoints):
    path = checkpoints[("qwen2", "bfloat16", True)]
    items = list(iter_hf_blocks(path))
    assert [i for i, _ in items] == [None, 0, 1]
    assert set(items[0][1]) == {"embeddings", "final_norm"}  # tied: no lm_head
    assert set(items[1][1]["attn"]) == {"w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v"}
    assert items[1][1]["attn"]["w_q"].dtype.name == "bfloat16"


def test_metadata_attached(checkpoints):
    tf = load_hf(checkpoints[("llama", "float32", True)])
    assert tf.source["format"] == "hf" and tf.source["model_type"] == "llama"
    assert tf.eos_token_ids == (2,)
    assert tf.generation_defaults.options.temperature == 0.0  # no do_sample in generation_config
    text = "Hello world, once upon a time"
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(checkpoints[("llama", "float32", True)] / "tokenizer.json"))
    assert tf.tokenizer.encode(text) == ref.encode(text, add_special_tokens=False).ids
    prompt = tf.chat_template.render([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sampling_generation_config(tmp_path):
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    path = make_tiny_checkpoint(tmp_path / "g", "qwen3", generation=gen)
    opts = load_hf(path).generation_defaults.options
    assert (opts.temperature, opts.top_p, opts.top_k) == (0.6, 0.95, 20)


# --- error cases --------------------------------------------------------------------------------


@pytest.fixture
def scratch(tmp_path, checkpoints) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(checkpoints[("qwen2", "float32", False)], dst)
    return dst


def _edit_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type", ["gemma", "phi3", "gpt2"])
def test_unknown_model_type(scratch, model_type):
    set_config_keys(scratch, model_type=model_type)
    with pytest.raises(UnsupportedError, match=model_type):
        entity.load(scratch)


def test_missing_tensor(scratch):
    _edit_weights(scratch, lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    with pytest.raises(WeightMappingError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        entity.load(scratch)


def test_extra_tensor(scratch):
    _edit_weights(
        scratch, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    )
    with pytest.raises(WeightMappingError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        entity.load(scratch)


def test_transposed_tensor(scratch):
    name = "model.layers.0.mlp.up_proj.weight"
    _edit_weights(scratch, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
    with pytest.raises(WeightMappingError, match=r"up_proj.*\(64, 128\).*\(128, 64\)"):
        entity.load(scratch)


def test_untied_without_lm_head(scratch):
    _edit_weights(scratch, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightMappingError, match="lm_head.weight"):
        entity.load(scratch)


def test_unsupported_rope_scaling(scratch):  # the types poly computes: test_rope_scaling.py
    set_config_keys(
        scratch, rope_parameters={"rope_type": "made-up", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(UnsupportedError, match="made-up"):
        entity.load(scratch)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}  # fmt: skip
    path = make_tiny_checkpoint(
        tmp_path / "l3", "llama", config_overrides={"rope_parameters": rope}
    )
    assert load_hf_config(path).rope_scaling is not None
    ours = load_hf(path).forward_all(PROMPT)
    np.testing.assert_allclose(ours, hf_logits(path, PROMPT), atol=1e-4, rtol=0)


def test_pytorch_bin_only(scratch):
    (scratch / "model.safetensors").unlink()
    (scratch / "pytorch_model.bin").write_bytes(b"\x80\x04\x95" + b"\x00" * 32)
    with pytest.raises(UnsafeFormatError):
        entity.load(scratch)


def test_bad_config_types_are_config_errors(scratch):
    set_config_keys(scratch, hidden_size="64")
    with pytest.raises(ConfigError, match="hidden_size"):
        entity.load(scratch)


def test_sliding_window_smaller_than_context(tmp_path):
    # the context is not clamped to the window (tests/test_attention_windows.py: exact past it)
    path = make_tiny_checkpoint(tmp_path / "m", "mistral", config_overrides={"sliding_window": 32})
    tf = load_hf(path, max_seq_len=64)
    assert tf.config.max_seq_len == 64 and tf.attn(0).sliding_window == 32


# --- entity.load identifies files by content, not by extension -----------------------------------


@pytest.mark.parametrize(
    "name,data,error",
    [
        ("model.gguf", b"\x80\x04\x95pickled", UnsafeFormatError),
        ("model.safetensors", b"PK\x03\x04zip", UnsafeFormatError),
        ("weights.entity", b"", FormatError),
        ("x.bin", b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14, FormatError),
        ("model.safetensors", b"GGUF\x03\x00\x00\x00", GGUFFormatError),
        ("model.gguf", b"ENTITY\x00\x00\xff\xff", EntityFormatError),
    ],
)
def test_load_dispatch_by_content(tmp_path, name, data, error):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(error):
        entity.load(path)


def test_load_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError):
        entity.load(tmp_path / "empty")
    with pytest.raises(ModelNotFoundError):
        entity.load(tmp_path / "nothing-here.gguf")


def test_bf16_store_of_a_bf16_checkpoint_is_lossless(checkpoints):
    # Weights already are bfloat16 values, so keeping them as bf16 must not move the logits.
    path = checkpoints[("llama", "bfloat16", False)]
    tf = load_hf(path, dtype="bfloat16")
    assert tf.embeddings.dtype.name == "bfloat16" and tf.lm_head.dtype.name == "bfloat16"
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)


def test_tokenizer_larger_than_vocab(scratch):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(scratch / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB
    tok.add_special_tokens(["<|extra|>"])  # id VOCAB: no embedding row for it
    tok.save(str(scratch / "tokenizer.json"))
    with pytest.raises(IntegrityError, match="token_id_out_of_range"):
        entity.load(scratch)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_parameter_count_equals_transformers(checkpoints, variant):
    from tests.hf_fixtures import cached_hf_model

    model = cached_hf_model(str(checkpoints[variant]))
    want = sum(p.numel() for p in model.parameters())
    assert load_hf(checkpoints[variant]).config.parameter_count == want


@pytest.mark.parametrize("arch", ARCHS)
def test_c_prefill_attention_keeps_parity(checkpoints, arch, monkeypatch):
    """The C prefill attention (gemm + softmax_causal) on every prompt: still transformers' logits."""
    from poly.runtime import attention, kernels

    if kernels.backend() != "c":
        pytest.skip("needs the C backend")
    monkeypatch.setattr(attention, "ATTEND_MIN", 0)
    path = checkpoints[(arch, "float32", False)]
    tf = entity.load(path)
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)
