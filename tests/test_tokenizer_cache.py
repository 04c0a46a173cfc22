"""The kept fast form of a tokenizer.json (poly.text.tokenizer_cache, issue 62: open time): a
second build from the same text reads it, skips the JSON checks and is the same tokenizer as
transformers'; a damaged kept file is ignored and written again; a model that is not BPE is
never kept; a tighter vocabulary cap checks the text again."""
# ruff: noqa: F811  (fixtures imported from tests.conftest_tokenizers are re-bound as arguments)

from __future__ import annotations

import json

import pytest

from poly.errors import LimitExceededError
from poly.text import tokenizer as tokmod
from poly.text.tokenizer import Tokenizer
from tests.conftest_tokenizers import (  # noqa: F401  (fixtures)
    SAMPLE_TEXTS,
    hf_smol_tokenizer,
    smol_hf_pair,
    smol_tokenizer_dir,
    sp_tokenizers,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POLY_HOME", str(tmp_path))
    monkeypatch.delenv("POLY_LAYOUT_CACHE", raising=False)
    return tmp_path / "tokenizers"


def _no_json(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the JSON was parsed although kept")

    monkeypatch.setattr(tokmod.json, "loads", refuse)


def test_a_kept_tokenizer_is_read_back_the_same(home, smol_tokenizer_dir, hf_smol_tokenizer,
                                                monkeypatch):  # fmt: skip
    text = (smol_tokenizer_dir / "tokenizer.json").read_text("utf-8")
    first = Tokenizer.from_str(text)
    kept = sorted(home.glob("*.json"))
    assert len(kept) == 1
    assert json.loads(kept[0].read_bytes())["model"]["merges"][0].count(" ") == 1  # "a b"
    with monkeypatch.context() as m:
        _no_json(m)
        second = Tokenizer.from_str(text)
    assert second._tk.to_str() == first._tk.to_str()
    for sample in SAMPLE_TEXTS:
        ids = hf_smol_tokenizer.encode(sample, add_special_tokens=False)
        assert second.encode(sample) == ids
        assert second.decode(ids) == hf_smol_tokenizer.decode(ids)
    kept[0].write_bytes(b"{not json")  # damaged: ignored, built from the text, kept anew
    third = Tokenizer.from_str(text)
    assert third._tk.to_str() == first._tk.to_str()
    assert json.loads(kept[0].read_bytes())["model"]["type"] == "BPE"


def test_a_tighter_cap_checks_a_kept_text_again(home, smol_tokenizer_dir, monkeypatch):
    text = (smol_tokenizer_dir / "tokenizer.json").read_text("utf-8")
    Tokenizer.from_str(text)
    monkeypatch.setattr(tokmod, "MAX_VOCAB", 1000)
    with pytest.raises(LimitExceededError):
        Tokenizer.from_str(text)


def test_other_models_and_a_switched_off_cache_keep_nothing(home, sp_tokenizers, monkeypatch):
    from tokenizers import Tokenizer as Raw
    from tokenizers.models import WordLevel

    words = Raw(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).to_str()
    Tokenizer.from_str(words)
    assert not list(home.glob("*.json")) and len(list(home.glob("*.skip"))) == 1
    monkeypatch.setenv("POLY_LAYOUT_CACHE", "0")
    Tokenizer.from_str(sp_tokenizers[0].to_str())
    assert not list(home.glob("*.json"))


def test_a_gguf_tokenizer_is_built_once(home, smollm2_gguf, hf_smol_tokenizer, monkeypatch):
    """The kept tokenizer of a GGUF is named by its metadata bytes: a second open builds none,
    nor reads the vocabulary's strings, and encodes as transformers' tokenizer of the same
    model."""
    from entity.gguf import tokenizer as gguf_tok
    from entity.gguf.header import StringArray
    from entity.gguf.reader import GGUFFile

    gg = GGUFFile(smollm2_gguf)
    first = gguf_tok.build_tokenizer(gg).tokenizer
    assert len(list(home.glob("*.json"))) == 1

    def refuse(*a, **k):
        raise AssertionError("built again although kept")

    monkeypatch.setattr(gguf_tok, "_construct", refuse)
    gg = GGUFFile(smollm2_gguf, later=gguf_tok.VOCABULARY_KEYS)
    second = gguf_tok.build_tokenizer(gg).tokenizer
    assert second.to_str() == first.to_str()
    assert all(isinstance(gg.metadata[k], StringArray) for k in gguf_tok.VOCABULARY_KEYS)
    for sample in SAMPLE_TEXTS:
        ids = hf_smol_tokenizer.encode(sample, add_special_tokens=False)
        assert second.encode(sample, add_special_tokens=False).ids == ids


def test_past_max_kept_the_least_recently_used_go(home, sp_tokenizers, monkeypatch):
    from poly.text import tokenizer_cache

    monkeypatch.setattr(tokenizer_cache, "MAX_KEPT", 2)
    text = sp_tokenizers[0].to_str()
    for pad in ("", " ", "  "):  # three texts of one tokenizer: three names
        Tokenizer.from_str(text + pad)
    assert len(list(home.iterdir())) == 2
