"""The event stream (stream_tokens / generate_text) and ChatSession's KV reuse across turns."""

from __future__ import annotations

import threading
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from poly.config import TransformerConfig
from poly.errors import (
    ContextOverflowError,
    GenerationError,
    InvalidTokenError,
    ModelBusyError,
    NumericalError,
    SamplingParamsError,
)
from poly.model.transformer import Transformer
from poly.text.chat import ChatTemplate
from poly.text.generation import DoneEvent, TokenEvent, generate_text, stream_tokens
from poly.text.sampling import GenOptions
from poly.text.session import ChatSession, common_prefix
from poly.text.tokenizer import Tokenizer
from tests.tiny_model import random_transformer

GREEDY = GenOptions(temperature=0.0, max_tokens=8)
IM_START, IM_END = 256, 257


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: every byte is one token, so tokenization is unique."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer.from_tokenizers(tk, eos_token="<|im_end|>")


TOK = byte_tokenizer()


def seq_logits(seq: list[int], vocab: int) -> np.ndarray:
    """Logits that depend on the whole sequence: a stale or misaligned cache changes them."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes()))
    return (rng.standard_normal(vocab) * 2.0).astype(np.float32)


class FakeModel:
    """The model protocol over a plain token list; records every forward() call."""

    def __init__(self, vocab=258, max_seq_len=512, eos=(IM_END,), tokenizer=TOK, script=None):
        self.config = SimpleNamespace(vocab_size=vocab, max_seq_len=max_seq_len)
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate.preset("chatml")
        self.eos_token_ids = tuple(eos)
        self.generation_defaults = None
        self.seq: list[int] = []
        self.calls: list[list[int]] = []
        self.script = script  # token ids to emit after the prompt, in order

    @property
    def position(self) -> int:
        return len(self.seq)

    def reset(self) -> None:
        self.seq = []

    def truncate(self, n: int) -> None:
        self.seq = self.seq[:n]

    def forward(self, ids) -> np.ndarray:
        ids = [int(t) for t in ids]
        if len(self.seq) + len(ids) > self.config.max_seq_len:
            raise ContextOverflowError("fake KV cache full")
        self.calls.append(ids)
        self.seq += ids
        if self.script is None:
            return seq_logits(self.seq, self.config.vocab_size)
        x = np.full(self.config.vocab_size, -10.0, dtype=np.float32)
        x[self.script[self._script_done() % len(self.script)]] = 10.0
        return x

    def _script_done(self) -> int:
        # how much of the script already ends the sequence (no position bookkeeping needed)
        for j in range(min(len(self.script), len(self.seq)), 0, -1):
            if self.seq[len(self.seq) - j :] == self.script[:j]:
                return j
        return 0


def scripted(text: str, eos=True, **kw) -> FakeModel:
    ids = TOK.encode(text) + ([IM_END] if eos else [])
    return FakeModel(script=ids, **kw)


def run(stream) -> tuple[list[TokenEvent], DoneEvent]:
    events = list(stream)
    assert isinstance(events[-1], DoneEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def reference_greedy(prompt: list[int], n: int, vocab=258, eos=(IM_END,)) -> list[int]:
    """Plain argmax loop over the full sequence each step (no cache at all)."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = int(np.argmax(seq_logits(seq, vocab)))
        out.append(t)
        if t in eos:
            break
        seq.append(t)
    return out


# --- the stream -----------------------------------------------------------------------------------


def test_greedy_stream_matches_plain_loop_and_metrics():
    m = FakeModel(eos=())
    prompt = TOK.encode("hello there")
    tokens, done = run(stream_tokens(m, prompt, GREEDY.replace(max_tokens=12)))
    want = reference_greedy(prompt, 12, eos=())
    assert [e.token_id for e in tokens] == want == list(done.tokens)
    assert [e.index for e in tokens] == list(range(12))
    assert done.stop_reason == "max_tokens"
    assert done.prompt_tokens == done.prefill_tokens == len(prompt)
    assert m.position == len(prompt) + 11  # the last token is never fed back
    assert m.calls[0] == prompt and all(len(c) == 1 for c in m.calls[1:])
    assert "".join(e.text for e in tokens) == done.text == TOK.decode(want)
    assert done.prefill_s >= 0 and done.decode_s >= 0 and done.decode_tok_s > 0


def test_eos_stops_and_is_not_in_text():
    m = scripted("Hi!")
    tokens, done = run(stream_tokens(m, TOK.encode("q"), GREEDY))
    assert done.stop_reason == "eos"
    assert done.tokens[-1] == IM_END and len(done.tokens) == 4
    assert done.text == "Hi!" and tokens[-1].text == ""


def test_min_tokens_suppresses_eos():
    m = FakeModel(script=[IM_END])  # EOS is always the favourite
    _, done = run(stream_tokens(m, [1, 2], GREEDY.replace(min_tokens=3)))
    assert done.stop_reason == "eos" and len(done.tokens) == 4
    assert IM_END not in done.tokens[:3]


@pytest.mark.parametrize("stop", [("STOP",), ("ST", "OP"), ("OP w",)])
def test_stop_strings_trim_the_text(stop):
    m = scripted("hello STOP world", eos=False)
    tokens, done = run(stream_tokens(m, [1], GREEDY.replace(max_tokens=30, stop=stop)))
    full = "hello STOP world"
    want = full[: min(full.find(s) for s in stop)]
    assert done.stop_reason == "stop_string"
    assert done.text == want == "".join(e.text for e in tokens)


def test_stop_string_prefix_released_when_no_match():
    m = scripted("a SToP", eos=True)
    tokens, done = run(stream_tokens(m, [1], GREEDY.replace(max_tokens=30, stop=("STOP",))))
    assert done.text == "a SToP" == "".join(e.text for e in tokens)
    assert done.stop_reason == "eos"


def test_stop_callback_and_should_stop_object():
    m = FakeModel(eos=())
    seen = []

    def stop():
        return len(seen) >= 3

    for ev in stream_tokens(m, [1, 2, 3], GREEDY, stop=stop):
        seen.append(ev)
    assert len(seen) == 4 and seen[-1].stop_reason == "stopped"
    assert m.position == 3 + 2  # three generated, the third never fed

    flag = SimpleNamespace(should_stop=lambda: True)
    _, done = run(stream_tokens(m, [1, 2, 3], GREEDY, stop=flag))
    assert done.tokens == () and done.stop_reason == "stopped"


def test_stop_callback_releases_held_back_text_into_done():
    m = scripted("abc STOx", eos=False)
    seen = []
    opts = GREEDY.replace(max_tokens=30, stop=("STOP",))
    for ev in stream_tokens(m, [1], opts, stop=lambda: len(seen) >= 7):
        seen.append(ev)
    assert "".join(e.text for e in seen[:-1]) == "abc "  # "STO" may start "STOP": held back
    assert seen[-1].text == "abc STO" and seen[-1].stop_reason == "stopped"


def test_history_ids_are_checked():
    m = FakeModel()
    generate_text(m, [1, 2, 3], GREEDY)
    with pytest.raises(InvalidTokenError):
        stream_tokens(m, [4], GREEDY, start_fresh=False, history=[1, 999])
    with pytest.raises(GenerationError):
        stream_tokens(m, [4], GREEDY, start_fresh=False, history=list(range(50)))


def test_context_overflow_raises_before_any_work():
    m = FakeModel(max_seq_len=32)
    with pytest.raises(ContextOverflowError):
        stream_tokens(m, list(range(20)), GREEDY.replace(max_tokens=13))
    assert m.calls == [] and m.position == 0
    _, done = run(stream_tokens(m, list(range(20)), GREEDY.replace(max_tokens=12)))
    assert len(done.tokens) <= 12


def test_truncate_output_and_left():
    m = FakeModel(max_seq_len=32, eos=())
    _, done = run(
        stream_tokens(m, list(range(20)), GREEDY.replace(max_tokens=50, truncate="output"))
    )
    assert done.stop_reason == "context" and len(done.tokens) == 12
    prompt = list(range(40))
    opts = GREEDY.replace(max_tokens=10, truncate="left")
    _, done = run(stream_tokens(m, prompt, opts))
    assert m.calls[-len(done.tokens)] == prompt[-22:]  # oldest tokens dropped
    assert done.stop_reason == "max_tokens" and done.prompt_tokens == 22


@pytest.mark.parametrize("bad", [[], [1, 258], [-1], [1.5, 2.0], [[1, 2]]])
def test_bad_prompts(bad):
    with pytest.raises(InvalidTokenError):
        stream_tokens(FakeModel(), bad, GREEDY)


def test_non_finite_logits_raise_and_release_the_lock():
    m = FakeModel()
    m.forward = lambda ids: np.full(258, np.nan, dtype=np.float32)
    with pytest.raises(NumericalError):
        generate_text(m, [1, 2], GREEDY)
    del m.forward
    assert generate_text(m, [1, 2], GREEDY).tokens  # the lock was released


@pytest.mark.parametrize("how", ["close", "with", "break"])
def test_closing_mid_stream_keeps_position_consistent(how):
    m = FakeModel(eos=())
    prompt = [5, 6, 7, 8]
    stream = stream_tokens(m, prompt, GREEDY.replace(max_tokens=20))
    got = []
    if how == "with":
        with stream:
            for ev in stream:
                got.append(ev.token_id)
                if len(got) == 3:
                    break
    else:
        for ev in stream:
            got.append(ev.token_id)
            if len(got) == 3:
                break
        if how == "close":
            stream.close()
        else:
            del stream  # garbage collection releases the lock too
    assert m.position == len(prompt) + 2
    assert m.seq == prompt + got[:2]
    assert got == reference_greedy(prompt, 3, eos=())
    assert generate_text(m, prompt, GREEDY).tokens  # not busy any more


def test_second_stream_is_busy_until_first_finishes():
    m = FakeModel(eos=())
    first = stream_tokens(m, [1, 2], GREEDY)
    next(first)
    with pytest.raises(ModelBusyError):
        stream_tokens(m, [3, 4], GREEDY)
    errors = []

    def other():
        try:
            stream_tokens(m, [3, 4], GREEDY)
        except ModelBusyError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1
    list(first)
    assert generate_text(m, [3, 4], GREEDY).tokens


def test_continue_without_reset_uses_the_cache():
    m = FakeModel(eos=())
    prompt = [9, 8, 7, 6]
    generate_text(m, prompt[:2], GREEDY.replace(max_tokens=1))
    assert m.position == 2
    _, done = run(stream_tokens(m, prompt[2:], GREEDY, start_fresh=False))
    assert m.calls[-len(done.tokens)] == prompt[2:]
    assert list(done.tokens) == reference_greedy(prompt, 8, eos=())
    assert done.prompt_tokens == 4 and done.prefill_tokens == 2


def test_seeded_sampling_is_reproducible():
    opts = GenOptions(temperature=1.0, top_k=0, seed=11, max_tokens=16)
    a = generate_text(FakeModel(eos=()), [1, 2, 3], opts).tokens
    b = generate_text(FakeModel(eos=()), [1, 2, 3], opts).tokens
    c = generate_text(FakeModel(eos=()), [1, 2, 3], opts.replace(seed=12)).tokens
    assert a == b and a != c


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
