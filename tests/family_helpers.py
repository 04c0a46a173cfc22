"""What the family tests (tests/test_families_*.py) check over and over, in one place: a model
against transformers (logits at every position within 1e-4, greedy tokens equal with and without
the KV cache), quantized files' top-1 along transformers' greedy path, `.entity` f32 exactness,
llama.cpp's converter (skipped when its sources are absent) and one-line load errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import entity
from tests.hf_fixtures import hf_greedy, hf_logits

N_NEW = 32
ATOL = 1e-4


def greedy(tf, ids: list[int], n: int, use_cache: bool) -> list[int]:
    """Our greedy continuation of `ids` (n tokens); without the cache the whole sequence is run
    again for every token."""
    tf.reset()
    out: list[int] = []
    logits = tf.forward(ids)
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        if use_cache:
            logits = tf.forward([out[-1]])
        else:
            tf.reset()
            logits = tf.forward(ids + out)
    return out


def assert_matches_transformers(tf, src: Path, prompt: list[int], n_new: int = N_NEW,
                                reference=None) -> list[int]:  # fmt: skip
    """Logits at every position within ATOL of transformers', then `n_new` greedy tokens equal
    with and without the KV cache; returns transformers' tokens. `reference`: (logits, greedy)
    functions to use instead of tests.hf_fixtures' AutoModelForCausalLM ones."""
    logits_fn, greedy_fn = reference or (hf_logits, hf_greedy)
    np.testing.assert_allclose(tf.forward_all(prompt), logits_fn(src, prompt), atol=ATOL, rtol=0)
    want = greedy_fn(src, prompt, n_new)
    assert greedy(tf, prompt, n_new, use_cache=True) == want
    assert greedy(tf, prompt, n_new, use_cache=False) == want
    return want


def assert_top1_along(model, prompt: list[int], want: list[int], at_least: int = 31) -> None:
    """A quantized model's argmax matches transformers' greedy tokens `want` (teacher-forced:
    the prompt and want[:-1] in one call) at least `at_least` times."""
    logits = model.forward_all(prompt + want[:-1])[len(prompt) - 1 :]
    assert int((logits.argmax(-1) == np.array(want)).sum()) >= at_least


def assert_entity_f32_exact(src: Path, tmp_path: Path, prompt: list[int]) -> None:
    """`entity.convert(quant="f32")` gives exactly the source's logits."""
    out = tmp_path / "model.f32.entity"
    entity.convert(src, out, quant="f32")
    np.testing.assert_array_equal(
        entity.load(out).forward_all(prompt), entity.load(src).forward_all(prompt)
    )


def converter_root() -> Path:
    """llama.cpp's converter sources (the llama-cpp-python sdist), or the test is skipped."""
    from benchmarks import llama_convert

    root = llama_convert.converter_dir()
    if root is None:
        pytest.skip("llama.cpp converter (llama-cpp-python sdist) not available")
    return root


def convert_gguf(src: Path, out: Path, kind: str = "f32") -> Path:
    """`src` written by llama.cpp's own convert_hf_to_gguf.py as `kind` (f32, q8_0, ...)."""
    from benchmarks import llama_convert

    return llama_convert.convert(src, out, kind, converter_root())


def assert_load_error(path: Path, cls: type, match: str) -> str:
    """entity.load(path) raises `cls` matching `match`, in one line; returns the message."""
    with pytest.raises(cls, match=match) as info:
        entity.load(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def with_user_token(src, dst):
    """The checkpoint with "<|user|>" added to its tokenizer: llama.cpp's Glm4Model.set_vocab
    reads that token (GLM-4's end of turn); the weights and ids of the other tokens are the same."""
    from transformers import PreTrainedTokenizerFast

    path = shutil.copytree(src, dst)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    assert len(tok) <= 304
    tok.save_pretrained(path)
    return path


def gguf_edit(src, dst, meta=None, drop=()):
    """A copy of a GGUF file with edited metadata and some tensors left out (gguf-py)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = (meta or {}).get(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
