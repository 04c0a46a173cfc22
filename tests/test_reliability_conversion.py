"""Reliability catalogue B7 (conversion and writing) and the fault tests of issue 8.

Faults run in forked children (RLIMIT_FSIZE, SIGKILL) so the test process stays clean; a small
tmpfs gives a real ENOSPC and a read-only filesystem when this machine allows mounting one.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from entity.atomic import STALE_MIN_AGE_S, TEMP_PATTERN
from entity.convert import DELAY_ENV, convert
from entity.dotentity.container import EntityFile
from entity.dotentity.read import load_entity
from poly.errors import (
    CheckpointError,
    InsufficientSpaceError,
    IntegrityError,
    OutputExistsError,
    OutputPathError,
    PolyError,
)
from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)
LAYERS = 8


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    return make_tiny_checkpoint(
        d / "llama", "llama", config_overrides={"num_hidden_layers": LAYERS}
    )


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    """A complete q4 conversion: the bytes every successful run must reproduce (determinism)."""
    out = tmp_path_factory.mktemp("ref") / "ref.entity"
    convert(src, out, quant="q4")
    return out.read_bytes()


def _leftovers(directory: Path) -> list[str]:
    return sorted(
        p.name for p in directory.iterdir() if TEMP_PATTERN.match(p.name) or ".payload" in p.name
    )


def _in_child(fn, *, fsize: int | None = None, env: dict | None = None) -> dict:
    """Run ``fn()`` in a forked child; returns {"ok": bool, "cls", "code"} or {"signal": n}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        out = {"ok": True}
        try:
            os.environ.update(env or {})
            if fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of a kill
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            fn()
        except PolyError as exc:
            out = {"ok": False, "cls": type(exc).__name__, "code": exc.code}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"ok": False, "cls": type(exc).__name__, "code": None, "msg": str(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return json.loads(data)


# --- B7-92 / 93 output path rules ----------------------------------------------------------------


def test_b7_92_output_is_the_input(src, tmp_path):
    first = tmp_path / "m.entity"
    convert(src, first, quant="q4")
    before = first.read_bytes()
    expect_error(
        lambda: convert(first, first, quant="f32", force=True), OutputPathError, "bad_output_path"
    )
    link = tmp_path / "link.entity"
    os.symlink(first, link)
    expect_error(lambda: convert(first, link, quant="f32", force=True), OutputPathError)
    hard = tmp_path / "hard.entity"
    os.link(first, hard)
    expect_error(lambda: convert(hard, first, quant="f32", force=True), OutputPathError)
    assert first.read_bytes() == before


def test_b7_93_output_exists(src, tmp_path, reference):
    out = tmp_path / "m.entity"
    out.write_bytes(b"precious")
    expect_error(lambda: convert(src, out, quant="q4"), OutputExistsError, "output_exists")
    assert out.read_bytes() == b"precious"
    convert(src, out, quant="q4", force=True)
    assert out.read_bytes() == reference
    assert _leftovers(tmp_path) == []


def test_b7_97_missing_output_dir(src, tmp_path):
    out = tmp_path / "missing" / "deeper" / "m.entity"
    expect_error(lambda: convert(src, out, quant="q4"), OutputPathError, "bad_output_path")
    assert not out.parent.exists()


def test_b7_97_output_path_is_a_directory(src, tmp_path):
    (tmp_path / "d.entity").mkdir()
    expect_error(
        lambda: convert(src, tmp_path / "d.entity", quant="q4", force=True), OutputPathError
    )


def _mount_tmpfs(path: Path, opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
    )
    return res.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_b7_97_read_only_output_dir(src, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    if os.geteuid() != 0:
        ro.mkdir()
        ro.chmod(0o555)
    elif not _mount_tmpfs(ro, "ro,size=1m"):
        # no mount here: make the temp-file creation fail the way a read-only fs does
        import errno

        ro.mkdir(exist_ok=True)
        real_open = os.open

        def ro_open(path, flags, *a, **k):
            if str(path).startswith(str(ro)) and flags & os.O_CREAT:
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", ro_open)
    try:
        expect_error(
            lambda: convert(src, ro / "m.entity", quant="q4"), OutputPathError, "bad_output_path"
        )
        assert list(ro.iterdir()) == []
    finally:
        monkeypatch.undo()
        if os.geteuid() == 0:
            _umount(ro)


# --- B7-94 disk full ----------------------------------------------------------------------------


def test_b7_94_rlimit_fsize_midway(src, tmp_path):
    out = tmp_path / "m.entity"
    # the plain bake: calibration runs the model, and OpenMP threads do not survive a fork
    res = _in_child(lambda: convert(src, out, quant="q4", calibrate=False), fsize=100_000)
    assert res == {"ok": False, "cls": "InsufficientSpaceError", "code": "no_space"}
    assert not out.exists() and _leftovers(tmp_path) == []


def test_b7_94_rlimit_fsize_keeps_old_output(src, tmp_path):
    out = tmp_path / "m.entity"
    out.write_bytes(b"old version")
    res = _in_child(lambda: convert(src, out, quant="f32", force=True), fsize=200_000)
    assert res["code"] == "no_space"
    assert out.read_bytes() == b"old version" and _leftovers(tmp_path) == []


def test_b7_94_small_tmpfs(src, tmp_path):
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "size=200k"):
        pytest.skip("cannot mount a tmpfs here (RLIMIT_FSIZE variant covers EFBIG)")
    try:
        out = mnt / "m.entity"
        exc = expect_error(
            lambda: convert(src, out, quant="f32"), InsufficientSpaceError, "no_space"
        )
        assert exc.path == str(out)
        assert list(mnt.iterdir()) == []
    finally:
        _umount(mnt)


# --- B7-95 SIGKILL (acceptance 3) ----------------------------------------------------------------


def test_acceptance_3_thirty_sigkills(src, tmp_path, reference):
    """30 kills at random moments: each output is absent or byte-identical to a complete run."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    rng = random.Random(8)
    env = {DELAY_ENV: "0.03"}
    outcomes = {"absent": 0, "complete": 0}
    for i in range(30):
        out = outdir / f"m{i}.entity"
        pid = os.fork()
        if pid == 0:
            try:
                os.environ.update(env)
                convert(src, out, quant="q4")
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.45))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if out.exists():
            assert out.read_bytes() == reference, f"trial {i}: torn or different output"
            EntityFile(out)  # header, layout and every checksum
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
    print(outcomes)
    assert sum(outcomes.values()) == 30
    # The next run in that directory sweeps the temp files the killed writers left behind
    # (once they are STALE_MIN_AGE_S old: younger unlocked files may be a writer starting up).
    time.sleep(STALE_MIN_AGE_S)
    convert(src, outdir / "clean.entity", quant="q4")
    assert _leftovers(outdir) == []


# --- B7-96 Ctrl-C inside the library ----------------------------------------------------------------


def test_b7_96_keyboard_interrupt_removes_temp(src, tmp_path):
    out = tmp_path / "m.entity"

    def progress(done, total, detail):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, out, quant="q4", progress=progress)
    assert not out.exists() and _leftovers(tmp_path) == []


# --- B7-98 .. 100 what is written ------------------------------------------------------------------


def _poison(src: Path, dst: Path, name: str, value: float) -> Path:
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    t = tensors[name].copy()
    t.reshape(-1)[0] = value
    tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("quant", ["q4", "q8", "f16"])
def test_b7_98_non_finite_source_refused(src, tmp_path, value, quant):
    bad = _poison(src, tmp_path / "bad", "model.layers.0.mlp.up_proj.weight", value)
    out = tmp_path / "m.entity"
    exc = expect_error(lambda: convert(bad, out, quant=quant), CheckpointError, seconds=30)
    assert exc.code in ("conversion_failed", "numerical"), exc.code
    assert not out.exists() and _leftovers(tmp_path) == []


def test_b7_98_f16_overflow_refused(src, tmp_path):
    bad = _poison(src, tmp_path / "bad", "model.layers.0.mlp.up_proj.weight", 1e6)
    out = tmp_path / "m.entity"
    exc = expect_error(lambda: convert(bad, out, quant="f16"), CheckpointError, seconds=30)
    assert exc.code == "conversion_failed"
    assert not out.exists()


def test_b7_99_extra_tensor(src, tmp_path):
    bad = _poison(src, tmp_path / "bad", "model.norm.weight", 1.0)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(bad / "model.safetensors"))
    tensors["vision_tower.proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "m.entity"
    exc = expect_error(lambda: convert(bad, out, quant="q4"), CheckpointError, seconds=30)
    assert exc.code in ("weight_mapping", "conversion_failed")
    assert "vision_tower" in str(exc) and not out.exists()


def test_b7_99_missing_tensor(src, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = _poison(src, tmp_path / "bad", "model.norm.weight", 1.0)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors.pop("model.layers.3.self_attn.k_proj.weight")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "m.entity"
    exc = expect_error(lambda: convert(bad, out, quant="q4"), CheckpointError, seconds=30)
    assert exc.code in ("weight_mapping", "conversion_failed") and "k_proj" in str(exc)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_b7_100_lossless_roundtrip_verified(src, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "m.entity"
    report = convert(src, out, quant="f32", verify=True)
    assert report.verified and report.exact
    tf = load_entity(out)
    ref = load_file(str(src / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(tf.embeddings), ref["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(tf.final_norm), ref["model.norm.weight"])
    assert tf.chat_template.source == json.loads((src / "tokenizer_config.json").read_text()).get(
        "chat_template",
        (src / "chat_template.jinja").read_text()
        if (src / "chat_template.jinja").exists()
        else None,
    )


def test_b7_100_roundtrip_mismatch_removes_output(src, tmp_path, monkeypatch):
    import sys

    conv = sys.modules["entity.convert"]  # `entity.convert` the attribute is the function
    real = conv.load_entity

    def damaged(path, **kw):
        tf = real(path, **kw)
        tf.embeddings = np.array(tf.embeddings) + np.float32(1e-3)
        return tf

    monkeypatch.setattr(conv, "load_entity", damaged)
    out = tmp_path / "m.entity"
    expect_error(
        lambda: convert(src, out, quant="f32", verify=True), IntegrityError, "integrity", seconds=30
    )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_b7_100_deterministic_bytes(src, tmp_path, reference):
    out = tmp_path / "again.entity"
    convert(src, out, quant="q4")
    assert out.read_bytes() == reference


def test_b7_100_metadata_survives(src, tmp_path):
    """Tokenizer, special ids, chat template and generation defaults survive HF -> .entity."""
    from entity.hf import load_hf

    out = tmp_path / "m.entity"
    convert(src, out, quant="q8", verify=True)
    a, b = load_hf(src), load_entity(out)
    text = "Héllo wörld <|im_end|> 0123"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.eos_token_ids == b.eos_token_ids and a.config == b.config
    msgs = [{"role": "user", "content": "hi"}]
    assert a.chat_template.render(msgs) == b.chat_template.render(msgs)
    assert a.generation_defaults == b.generation_defaults


def test_b7_100_gguf_source_lossless(tmp_path):
    from entity.gguf.loader import load_gguf
    from tests.fuzz.corpus import byte_vocab, gguf_model

    g = tmp_path / "m.gguf"
    g.write_bytes(gguf_model(tokens=byte_vocab(), hidden=32, layers=2))
    out = tmp_path / "m.entity"
    report = convert(g, out, quant="f32", verify=True)
    assert report.verified and report.exact
    ids = [5, 17, 99, 256]
    want = load_gguf(g, keep_quantized=False).forward_all(ids)
    np.testing.assert_array_equal(load_entity(out).forward_all(ids), want)
