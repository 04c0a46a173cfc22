"""poly.text.tokenizer against transformers (real SmolLM2 tokenizer, and a trained SentencePiece BPE)."""
# ruff: noqa: F811  (fixtures imported from tests.conftest_tokenizers are re-bound as arguments)

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poly.errors import InvalidTokenError, LimitExceededError, TokenizerError
from poly.text.tokenizer import StreamDecoder, Tokenizer
from tests.conftest_tokenizers import (  # noqa: F401  (fixtures)
    SAMPLE_TEXTS,
    hf_smol_tokenizer,
    smol_hf_pair,
    smol_tokenizer_dir,
    sp_tokenizers,
)

NON_EMPTY = [t for t in SAMPLE_TEXTS if t]


@pytest.fixture(scope="module")
def smol(smol_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(smol_tokenizer_dir)


@pytest.fixture(scope="module")
def sp(sp_tokenizers) -> Tokenizer:
    return Tokenizer.from_str(sp_tokenizers[0].to_str(), bos_token="<s>", eos_token="</s>")


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> tuple[list[str], str]:
    sd = StreamDecoder(tok, skip_special_tokens=skip)
    pieces = [sd.push(i) for i in ids]
    pieces.append(sd.flush())
    return pieces, "".join(pieces)


# --- the real SmolLM2 tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
@pytest.mark.parametrize("special", [False, True])
def test_smol_encode_matches_transformers(smol, hf_smol_tokenizer, text, special):
    expected = hf_smol_tokenizer.encode(text, add_special_tokens=special)
    assert smol.encode(text, add_special_tokens=special) == expected


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_smol_decode_and_stream_match_transformers(smol, hf_smol_tokenizer, text, skip):
    ids = hf_smol_tokenizer.encode(text, add_special_tokens=False)
    expected = hf_smol_tokenizer.decode(ids, skip_special_tokens=skip)
    assert smol.decode(ids, skip_special_tokens=skip) == expected
    assert _stream(smol, ids, skip)[1] == expected


def test_smol_vocabulary_matches_transformers(smol, hf_smol_tokenizer):
    hf = hf_smol_tokenizer
    assert smol.vocab_size == len(hf)
    hf_special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert smol.special_token_ids == hf_special
    assert [t.content for t in smol.added_tokens] == [
        hf.added_tokens_decoder[t.id].content for t in smol.added_tokens
    ]
    assert (smol.bos_token, smol.eos_token) == (hf.bos_token, hf.eos_token)
    assert (smol.bos_token_id, smol.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for token_id in (0, 1, 2, 100, 1000, 30000, len(hf) - 1):
        token = hf.convert_ids_to_tokens(token_id)
        assert smol.id_to_token(token_id) == token
        assert smol.token_to_id(token) == token_id
    assert smol.byte_fallback_ids == frozenset()


def test_round_trip_through_to_str(smol, hf_smol_tokenizer):
    again = Tokenizer.from_str(smol.to_str())
    for text in NON_EMPTY:
        assert again.encode(text) == hf_smol_tokenizer.encode(text, add_special_tokens=False)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_smol_stream_equals_decode_on_random_ids(smol, hf_smol_tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, smol.vocab_size - 1), min_size=1, max_size=24))
    skip = data.draw(st.booleans())
    assert _stream(smol, ids, skip)[1] == hf_smol_tokenizer.decode(ids, skip_special_tokens=skip)


def test_stream_holds_back_incomplete_utf8(smol, hf_smol_tokenizer):
    # A byte-level BPE splits an emoji into several tokens; none may emit half a character.
    text = "a🤖👋🏽日"
    ids = hf_smol_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # really split
    pieces, joined = _stream(smol, ids)
    assert joined == text
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # whole code points only


def test_stream_work_is_linear(smol, hf_smol_tokenizer, monkeypatch):
    # O(1) amortized: the ids decoded per push stay bounded however long the stream gets.
    ids = hf_smol_tokenizer.encode(" ".join(NON_EMPTY) * 20, add_special_tokens=False)
    decoded = []
    real = Tokenizer.decode
    monkeypatch.setattr(
        Tokenizer, "decode", lambda self, x, **kw: decoded.append(len(x)) or real(self, x, **kw)
    )
    _stream(smol, ids)
    assert max(decoded) <= 16
    assert sum(decoded) <= 16 * len(ids)


# --- a SentencePiece-style BPE with byte fallback, trained here ------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_sp_matches_transformers(sp, sp_tokenizers, text):
    hf = sp_tokenizers[1]
    ids = hf.encode(text, add_special_tokens=False)
    assert sp.encode(text) == ids
    assert sp.encode(text, add_special_tokens=True) == hf.encode(text)
    for skip in (False, True):
        expected = hf.decode(ids, skip_special_tokens=skip)
        assert sp.decode(ids, skip_special_tokens=skip) == expected
        assert _stream(sp, ids, skip)[1] == expected


def test_sp_byte_fallback_is_used_and_held_back(sp, sp_tokenizers):
    ids = sp.encode("日")
    bytes_ids = [sp.token_to_id(f"<0x{b:02X}>") for b in "日".encode()]
    assert ids[-3:] == bytes_ids
    assert set(bytes_ids) <= sp.byte_fallback_ids
    sd = StreamDecoder(sp)
    assert [sd.push(i) for i in bytes_ids] == ["", "", ""]
    assert sd.push(sp.token_to_id("</s>")) == "日</s>"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sp_stream_equals_decode_on_random_ids(sp, sp_tokenizers, data):
    # Random ids include invalid byte runs: decode turns a whole bad run into U+FFFDs.
    ids = data.draw(st.lists(st.integers(0, sp.vocab_size - 1), min_size=1, max_size=24))
    skip = data.draw(st.booleans())
    assert _stream(sp, ids, skip)[1] == sp_tokenizers[1].decode(ids, skip_special_tokens=skip)


# --- bad inputs -----------------------------------------------------------------------------


def _bpe_json(**model) -> dict:
    base = {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
    base.update(model)
    return {"version": "1.0", "model": base}


@pytest.mark.parametrize(
    "text",
    [
        "not json at all",
        "{",
        "[]",
        "{}",
        '{"model": 3}',
        json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}),
        json.dumps(_bpe_json(merges=["a zz"])),  # merge of a token not in the vocab
        json.dumps(_bpe_json(unk_token="<unk>")),  # unk not in the vocab
    ],
)
def test_invalid_tokenizer_json_raises_tokenizer_error(text):
    with pytest.raises(TokenizerError):
        Tokenizer.from_str(text)


def test_valid_minimal_bpe_loads():
    tok = Tokenizer.from_str(json.dumps(_bpe_json()))
    assert tok.encode("ab") == [2]


def test_nested_quantifier_regex_is_rejected():
    data = _bpe_json()
    data["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "(a+)+$"},
        "behavior": "Isolated",
        "invert": False,
    }
    with pytest.raises(TokenizerError, match="nested quantifier"):
        Tokenizer.from_str(json.dumps(data))


def test_file_errors(tmp_path, monkeypatch):
    with pytest.raises(TokenizerError):
        Tokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{not utf8")
    with pytest.raises(TokenizerError):
        Tokenizer.from_file(bad)
    monkeypatch.setattr("poly.text.tokenizer.MAX_TOKENIZER_BYTES", 4)
    with pytest.raises(LimitExceededError):
        Tokenizer.from_file(bad)


def test_out_of_range_ids_and_bad_specials(smol):
    with pytest.raises(InvalidTokenError):
        smol.decode([1, smol.vocab_size])
    with pytest.raises(InvalidTokenError):
        StreamDecoder(smol).push(-1)
    with pytest.raises(TokenizerError):
        smol.apply_config({"eos_token": "<no such token>"})
    with pytest.raises(TokenizerError):
        smol.apply_config({"bos_token": 7})
    assert smol.eos_token == "<|im_end|>"  # a failed update leaves the object usable


def test_lone_surrogates_do_not_crash(smol):
    text = b"caf\xc3\xa9 \xff".decode("utf-8", "surrogateescape")
    assert smol.decode(smol.encode(text)) == "café \ufffd"


def test_concurrent_encode_is_safe(smol, hf_smol_tokenizer):
    expected = {t: hf_smol_tokenizer.encode(t, add_special_tokens=False) for t in NON_EMPTY}
    errors = []

    def work():
        try:
            for _ in range(20):
                for text, ids in expected.items():
                    assert smol.encode(text) == ids
        except Exception as e:  # collected for the main thread
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
