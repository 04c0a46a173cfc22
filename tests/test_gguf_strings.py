"""GGUF string arrays (a vocabulary, its merges): read in one fast loop, checked like strings."""

from __future__ import annotations

import struct

import pytest

from tests.fuzz.corpus import ARRAY, STRING
from tests.fuzz.corpus import gguf_pack as write_gguf
from tests.fuzz.corpus import gstr as _str
from tests.test_gguf_reader import (
    KVS,
    TENSORS,
    assert_bad,
    open_bytes,
    valid_bytes,
)


def test_string_array_elements_are_checked_like_strings(tmp_path):
    """The vocabulary's fast loop (GGUFFile reads ~100k strings) gives the same errors, at the
    same offsets, as one string read at a time."""
    tokens = ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", b"\xc3", "c"]))
    data = write_gguf([*KVS[:4], tokens], TENSORS)
    err = assert_bad(tmp_path, data, "element of .*UTF-8")
    assert err.offset == data.index(_str(b"\xc3")) + 8  # past the length, as string() says
    data = valid_bytes()
    # past the key, its type, the array's element type and count, and element "a": "b"'s length
    key = "tokenizer.ggml.tokens"
    second = data.index(_str(key)) + 8 + len(key) + 4 + 4 + 8 + 8 + 1
    assert data[second : second + 9] == _str("b")
    err = assert_bad(
        tmp_path,
        data[:second] + struct.pack("<Q", 2**40) + data[second + 8 :],
        "element of .*length",
    )
    assert err.offset == second
    many = ("tokenizer.ggml.tokens", ARRAY, (STRING, [f"t{i}ü" for i in range(5000)]))
    gg = open_bytes(tmp_path, write_gguf([*KVS[:4], many], TENSORS))
    assert gg.metadata["tokenizer.ggml.tokens"] == [f"t{i}ü" for i in range(5000)]


def test_byte_level_vocab_respells_outsiders_and_keeps_a_repeat_first(tmp_path):
    from entity.gguf.tokenizer import build_tokenizer

    kvs = [*KVS[:4], ("tokenizer.ggml.model", STRING, "gpt2"),
           ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "ab", "a", "日"])),
           ("tokenizer.ggml.merges", ARRAY, (STRING, ["a b"]))]  # fmt: skip
    tok = build_tokenizer(open_bytes(tmp_path, write_gguf(kvs, TENSORS))).tokenizer
    vocab = tok.get_vocab()
    spelled = "".join(chr(c) for c in (0x00E6, 0x0139, 0x00A5))  # "日"'s UTF-8 bytes, GPT-2 spelled
    assert vocab["a"] == 0 and vocab["ab"] == 2 and vocab[spelled] == 4 and "日" not in vocab
    assert tok.encode("ab").ids == [2]


def test_the_c_reader_reads_what_the_loop_reads_and_leaves_errors_to_it(tmp_path):
    import pytest

    from entity.gguf.header import Cursor
    from poly.runtime.ckernels import EXT

    if getattr(EXT, "gguf_strings", None) is None:
        pytest.skip("the C extension is not built")
    words = ["", "a", "Ġthe", "日本語", "👋🏽", "x" * 300] * 40
    blob = b"".join(_str(w) for w in words) + b"tail"
    assert EXT.gguf_strings(blob, 0, len(words), 1 << 20) == (words, len(blob) - 4)
    loop = Cursor(blob, "mem")
    assert loop.strings(len(words), "element", 1 << 20) == words  # the C path, via the cursor
    assert EXT.gguf_strings(blob, 0, len(words), 299) is None  # "x" * 300 over the cap
    assert EXT.gguf_strings(blob[:-10], 0, len(words), 1 << 20) is None  # truncated
    assert EXT.gguf_strings(blob, 0, len(blob), 1 << 20) is None  # count past the buffer
    # a bad element among many: the C reader declines, the loop names it at its offset
    bad = [f"t{i}" for i in range(200)]
    data = write_gguf([*KVS[:4], ("tokenizer.ggml.tokens", ARRAY, (STRING, [*bad, b"\xc3"]))],
                      TENSORS)  # fmt: skip
    err = assert_bad(tmp_path, data, "element of .*UTF-8")
    assert err.offset == data.index(_str(b"\xc3")) + 8


def test_merge_pairs_split_at_the_first_space_as_the_python_path():
    from poly.runtime.ckernels import EXT

    split = getattr(EXT, "merge_pairs", None)
    if split is None:
        pytest.skip("no C extension")
    merges = ["Ġ t", "a b c", "é ü", "x  y", " lead"]
    assert split(merges) == [tuple(m.split(" ", 1)) for m in merges]
    assert split(["nospace"]) is None and split(["a b", 3]) is None
    assert split([]) == []


def test_strings_left_for_later_are_read_checked_when_asked(tmp_path):
    """`GGUFFile(later=...)` checks a string array's lengths at the parse and reads it only at
    `strings`: the same list as an eager parse, and a bad element still a GGUFFormatError naming
    its offset (then, not at the parse)."""
    from entity.gguf.header import StringArray
    from entity.gguf.reader import GGUFFile
    from entity.gguf.tokenizer import VOCABULARY_KEYS
    from poly.errors import GGUFFormatError
    from poly.runtime.ckernels import EXT

    if getattr(EXT, "gguf_strings_end", None) is None:
        pytest.skip("the C extension is not built")
    words = [f"t{i}ü" for i in range(300)]
    path = tmp_path / "later.gguf"
    path.write_bytes(write_gguf([*KVS[:4], ("tokenizer.ggml.tokens", ARRAY, (STRING, words))],
                                TENSORS))  # fmt: skip
    gg = GGUFFile(path, later=VOCABULARY_KEYS)
    left = gg.metadata["tokenizer.ggml.tokens"]
    assert isinstance(left, StringArray) and len(left) == len(words)
    assert gg.strings("tokenizer.ggml.tokens") == words == GGUFFile(path).metadata[
        "tokenizer.ggml.tokens"]  # fmt: skip
    assert gg.metadata["tokenizer.ggml.tokens"] == words  # read once, kept
    data = write_gguf([*KVS[:4], ("tokenizer.ggml.tokens", ARRAY, (STRING, [*words, b"\xc3"]))],
                      TENSORS)  # fmt: skip
    path.write_bytes(data)
    gg = GGUFFile(path, later=VOCABULARY_KEYS)  # lengths sound: the parse passes
    with pytest.raises(GGUFFormatError, match="element of .*UTF-8") as err:
        gg.strings("tokenizer.ggml.tokens")
    assert err.value.offset == data.index(_str(b"\xc3")) + 8
    long = data.index(_str(b"\xc3"))  # a length past the file: refused at the parse
    path.write_bytes(data[:long] + struct.pack("<Q", 2**40) + data[long + 8 :])
    with pytest.raises(GGUFFormatError, match="element of .*length"):
        GGUFFile(path, later=VOCABULARY_KEYS)
