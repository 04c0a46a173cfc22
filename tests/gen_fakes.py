"""Shared fakes for the generation tests: a byte tokenizer, a scripted model, helpers."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from poly.errors import (
    ContextOverflowError,
)
from poly.text.chat import ChatTemplate
from poly.text.generation import DoneEvent, TokenEvent
from poly.text.sampling import GenOptions
from poly.text.tokenizer import Tokenizer

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
