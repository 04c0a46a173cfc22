"""llama.cpp's own HF -> GGUF converter (vendored in the llama-cpp-python sdist), for tests and
benchmarks that check our GGUF path against files llama.cpp itself produced.

The sdist is found at $POLY_LLAMA_CPP_SRC (a dir holding vendor/llama.cpp), else fetched once with
``pip download --no-deps --no-binary :all: llama-cpp-python==<installed>`` into
~/.cache/poly/llama-cpp-src and unpacked (only the converter, its ``conversion`` package and
gguf-py). The converter runs in a subprocess with two shims for our tiny checkpoints: a stub
``sentencepiece`` (there is no tokenizer.model; the converter then falls back to tokenizer.json;
families that insist on tokenizer.model, Gemma 1/2, get the tokenizer.json vocab instead)
and the pre-tokenizer name "gpt-2" for the test BPE (its hash is not in llama.cpp's list; the
pre-tokenizer does not affect logits on given token ids).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path.home() / ".cache" / "poly" / "llama-cpp-src"
_SHIM = """
import sys
sys.path[:0] = [{root!r}, {stub!r}]
from conversion import base
if {test_bpe!r}:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    # Gemma 1/2 read tokenizer.model only; the test BPE has tokenizer.json (vocab, not weights)
    base.TextModel._set_vocab_sentencepiece = lambda self, add_to_gguf=True: self._set_vocab_gpt2()
_extra = {hparams!r}
if _extra:  # config keys transformers' AutoConfig drops and the converter reads (rotary_pct)
    _load = base.ModelBase.load_hparams
    base.ModelBase.load_hparams = staticmethod(lambda d, m: {{**_load(d, m), **_extra}})
import convert_hf_to_gguf as c
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outfile", {out!r}, "--outtype", {kind!r}]
c.main()
"""


def _unpack(tgz: Path, dest: Path) -> Path | None:
    wanted = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
              "vendor/llama.cpp/gguf-py/")  # fmt: skip
    with tarfile.open(tgz) as tar:
        members = [m for m in tar.getmembers() if any(w in m.name for w in wanted)]
        tar.extractall(dest, members=members, filter="data")
    found = sorted(dest.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[0].parent if found else None


def converter_dir() -> Path | None:
    """vendor/llama.cpp of the sdist (None when it cannot be had)."""
    env = os.environ.get("POLY_LLAMA_CPP_SRC")
    roots = [Path(env)] if env else []
    roots.append(CACHE)
    for root in roots:
        found = sorted(root.glob("**/vendor/llama.cpp/convert_hf_to_gguf.py"))
        if found:
            return found[0].parent
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
           f"llama-cpp-python=={version}", "-d", str(CACHE)]  # fmt: skip
    if subprocess.run(cmd, capture_output=True, timeout=900).returncode:
        return None
    tgz = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    return _unpack(tgz[0], CACHE) if tgz else None


def convert(
    model_dir: Path, out: Path, kind: str, root: Path, test_bpe: bool = True,
    hparams: dict | None = None,
) -> Path:  # fmt: skip
    """Run llama.cpp's converter: HF snapshot ``model_dir`` -> ``out`` (kind f32|f16|q8_0).
    ``test_bpe=False``: a real model's tokenizer, whose pre-tokenizer llama.cpp recognises.
    ``hparams``: keys added to the config the converter reads (GPT-NeoX's ``rotary_pct``, which
    transformers 5's AutoConfig folds into rope_parameters)."""
    stub = out.parent / "_sp_stub"
    stub.mkdir(exist_ok=True)
    (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    code = _SHIM.format(root=str(root), stub=str(stub), src=str(model_dir), out=str(out), kind=kind,
                       test_bpe=test_bpe, hparams=hparams or {})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600, cwd=str(out.parent))  # fmt: skip
    if res.returncode or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf failed: {res.stderr[-2000:]}")
    return out
