"""ChatSession's KV reuse across turns, on fakes, a tiny Transformer and SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from poly.config import TransformerConfig
from poly.errors import (
    ContextOverflowError,
    GenerationError,
    ModelBusyError,
    SamplingParamsError,
)
from poly.model.transformer import Transformer
from poly.text.chat import ChatTemplate
from poly.text.generation import generate_text, stream_tokens
from poly.text.sampling import GenOptions
from poly.text.session import ChatSession, common_prefix
from tests.gen_fakes import (
    GREEDY,
    IM_END,
    IM_START,
    TOK,
    FakeModel,
    run,
    scripted,
)
from tests.tiny_model import random_transformer

# --- chat sessions --------------------------------------------------------------------------------


def encode_chat(messages) -> list[int]:
    text = ChatTemplate.preset("chatml").render(messages, add_generation_prompt=True)
    return TOK.encode(text)


def test_session_second_turn_prefills_only_new_tokens():
    m = scripted("Sure, here.")
    s = ChatSession(m, system="Be brief.", options=GREEDY.replace(max_tokens=40))
    _, d1 = run(s.send("hi"))
    ids1 = encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert d1.text == "Sure, here." and d1.stop_reason == "eos"
    assert s.last_prefill_tokens == len(ids1) == m.calls[0].__len__()
    n_calls = len(m.calls)
    _, d2 = run(s.send("more"))
    ids2 = encode_chat(s.history[:-1])
    cached = ids1 + list(d1.tokens[:-1])
    assert ids2[: len(cached)] == cached  # the whole cache is reused
    assert s.last_prefill_tokens == len(ids2) - len(cached) == len(m.calls[n_calls])
    assert d2.prefill_tokens == s.last_prefill_tokens and d2.prompt_tokens == len(ids2)
    assert s.history[-1] == {"role": "assistant", "content": "Sure, here."}
    assert s.stats["turns"] == 2 and s.stats["tokens_in_cache"] == m.position
    assert s.stats["turns_in_history"] == 2
    assert s.drop_oldest_turns(1) == 1
    assert s.stats["turns"] == 2 and s.stats["turns_in_history"] == 1


def test_session_turns_equal_fresh_generation():
    """Unscripted replies (odd bytes, no EOS) force divergence; results match a fresh run."""
    m = FakeModel()
    s = ChatSession(m, options=GREEDY.replace(max_tokens=6))
    for user in ("one", "two", "three"):
        before = list(m.seq)
        _, done = run(s.send(user))
        ids = encode_chat(s.history[:-1])
        assert done.tokens == generate_text(FakeModel(), ids, s.options).tokens
        assert done.prefill_tokens == len(ids) - common_prefix(ids, before)
        assert m.seq == (ids + list(done.tokens))[: m.position]


def test_session_close_mid_reply_keeps_partial_turn_and_cache():
    m = scripted("abcdefghij", eos=False)
    s = ChatSession(m, options=GREEDY.replace(max_tokens=20))
    stream = s.send("go")
    for i, _ev in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert s.history[-1] == {"role": "assistant", "content": "abcd"}
    _, done = run(s.send("again"))  # not busy, cache consistent
    assert m.seq == (encode_chat(s.history[:-1]) + list(done.tokens))[: m.position]


def test_session_overflow_and_drop_oldest_turns():
    m = scripted("reply text here")
    s = ChatSession(m, system="sys", options=GREEDY.replace(max_tokens=20))
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "x" * 40}]
    m.config.max_seq_len = len(encode_chat(first)) + 25
    _, d1 = run(s.send("x" * 40))
    before = s.history
    with pytest.raises(ContextOverflowError):
        s.send("y" * 40)
    assert s.history == before  # nothing changed
    assert s.drop_oldest_turns() == 1
    _, done = run(s.send("y" * 40))
    cache = encode_chat(first) + list(d1.tokens[:-1])
    head = common_prefix(cache, encode_chat(s.history[:-1]))
    assert 0 < head < len(encode_chat(first))
    assert done.prefill_tokens == done.prompt_tokens - head  # re-prefilled from the divergence
    assert len(s.history) == 3
    s.reset()
    with pytest.raises(GenerationError):
        s.drop_oldest_turns()


def test_session_options_system_reset_and_busy():
    m = scripted("ok")
    s = ChatSession(m, options=GREEDY)
    s.set_option("max_tokens", 2)
    assert s.options.max_tokens == 2
    with pytest.raises(SamplingParamsError, match="top_p"):
        s.set_option("top_p", 0.0)
    run(s.send("a"))
    s.set_system("new")
    assert s.history == [{"role": "system", "content": "new"}] and m.position == 0
    other = stream_tokens(m, [1, 2], GREEDY)
    next(other)
    with pytest.raises(ModelBusyError):
        s.send("b")
    other.close()
    _, done = run(s.send("b"))
    assert done.text == "ok"


# --- the real Transformer ---------------------------------------------------------------------------


def make_tiny() -> Transformer:
    cfg = TransformerConfig(
        vocab_size=258, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, max_seq_len=256, tie_word_embeddings=True,
    )  # fmt: skip
    # masters ~N(0, 0.2) with norm gammas ~N(1, 0.2), the tied table ~N(0, 1), final norm 1
    m = random_transformer(cfg, norm_shift=1.0, head_scale=None, final_norm_scale=None)
    m.tokenizer, m.chat_template = TOK, ChatTemplate.preset("chatml")
    m.eos_token_ids = (IM_END,)
    return m


@pytest.fixture(scope="module")
def tiny():
    return make_tiny()


def test_real_transformer_stream_matches_forward_all(tiny):
    prompt = TOK.encode("The cat")
    _, done = run(stream_tokens(tiny, prompt, GREEDY.replace(max_tokens=10)))
    seq = list(prompt)
    for t in done.tokens:  # reference: full recompute with forward_all, no cache reuse
        tiny.reset()
        assert int(np.argmax(tiny.forward_all(seq)[-1])) == t
        seq.append(t)


def test_real_transformer_session_reuses_cache(tiny):
    # ban bytes that are not printable ASCII so the reply re-tokenizes to the same ids
    odd = [
        i for i in range(256) if not TOK.decode([i]).isprintable() or not TOK.decode([i]).isascii()
    ]
    opts = GREEDY.replace(max_tokens=6, banned_tokens=tuple(odd) + (IM_START,))
    s = ChatSession(tiny, system="S", options=opts)
    _, d1 = run(s.send("hello"))
    ids1 = encode_chat(s.history[:-1])
    _, d2 = run(s.send("again"))
    ids2 = encode_chat(s.history[:-1])
    cached = len(ids1) + len(d1.tokens) - 1  # the last reply token was never fed
    assert common_prefix(ids2, ids1 + list(d1.tokens)) >= cached
    assert d2.prefill_tokens == len(ids2) - cached and d2.prompt_tokens == len(ids2)
    tiny.reset()
    assert generate_text(tiny, ids2, s.options).tokens == d2.tokens


def test_real_transformer_session_divergent_reply_matches_fresh(tiny):
    """Replies of stray bytes re-render differently: re-prefill from the divergence point."""
    s, fresh = ChatSession(tiny, options=GREEDY.replace(max_tokens=5)), make_tiny()
    for turn, user in enumerate(("hello", "again", "third")):
        _, done = run(s.send(user))
        ids = encode_chat(s.history[:-1])
        assert turn == 0 or done.prefill_tokens < len(ids)  # reuse, even past a divergence
        assert generate_text(fresh, ids, s.options).tokens == done.tokens


# --- the real SmolLM2-135M-Instruct -----------------------------------------------------------------


def test_smollm2_session_second_turn_prefills_only_new_tokens(smollm2_gguf):
    from entity.gguf.loader import load_gguf

    model = load_gguf(smollm2_gguf, max_seq_len=256, keep_quantized=False)
    opts = GenOptions(temperature=0.0, max_tokens=2)
    s = ChatSession(model, system="You are a helpful assistant.", options=opts)
    _, d1 = run(s.send("What is the capital of France?"))
    ids1 = model.tokenizer.encode(model.chat_template.render(s.history[:-1]))
    _, d2 = run(s.send("And of Germany?"))
    ids2 = model.tokenizer.encode(model.chat_template.render(s.history[:-1]))
    cached = ids1 + list(d1.tokens[:-1])
    assert d2.prompt_tokens == len(ids2)
    assert d2.prefill_tokens == len(ids2) - common_prefix(ids2, cached) < len(ids2) // 2
    assert generate_text(model, ids2, opts).tokens == d2.tokens  # same as a fresh prefill
