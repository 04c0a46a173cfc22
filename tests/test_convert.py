"""Conversion to `.entity` (issue 4 acceptance): parity, lossy bounds, self-containment,
integrity under damage, atomicity under SIGKILL, output-path errors, RSS of a mapped q4 file."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from entity.atomic import STALE_MIN_AGE_S
from entity.convert import DELAY_ENV, convert
from entity.dotentity.container import EntityFile
from entity.dotentity.read import load_entity
from poly.errors import EntityFormatError, IntegrityError, OutputExistsError, OutputPathError
from tests.hf_fixtures import hf_logits, make_tiny_checkpoint

IDS = [0, 5, 17, 3, 42, 8, 11, 60]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    cases = {"llama": False, "llama-tied": True, "qwen2": False, "qwen3": True}
    return {
        name: make_tiny_checkpoint(base / name, name.split("-")[0], tied=tied, seed=i)
        for i, (name, tied) in enumerate(cases.items())
    }


@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_f32_logits_equal_the_hf_path_exactly(ckpts, tmp_path, name):
    from entity.hf import load_hf

    src = ckpts[name]
    report = convert(src, tmp_path / "m.entity", quant="f32", verify=True)
    assert report.exact and report.verified
    tf = load_entity(tmp_path / "m.entity")
    assert tf.tied == name.endswith("tied") or (name == "qwen3") == tf.tied
    got = tf.forward_all(IDS)
    np.testing.assert_array_equal(got, load_hf(src).forward_all(IDS))  # 0 difference
    np.testing.assert_allclose(got, hf_logits(src, IDS), atol=1e-4, rtol=0)  # transformers


def _greedy(tf, prompt: list[int], n: int) -> list[int]:
    tf.reset()
    out, logits = [], tf.forward(prompt)
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = tf.forward([out[-1]])
    tf.reset()
    return out


def test_q8_top1_agrees_with_f32(ckpts, tmp_path):
    src = ckpts["qwen2"]
    convert(src, tmp_path / "f32.entity", quant="f32")
    convert(src, tmp_path / "q8.entity", quant="q8")
    f32 = load_entity(tmp_path / "f32.entity", max_seq_len=128)
    q8 = load_entity(tmp_path / "q8.entity", max_seq_len=128)
    prompt = IDS[:4]
    seq = prompt + _greedy(f32, prompt, 64)
    # Teacher-forced on the f32 greedy sequence: next-token choices at the 64 generated steps.
    ref = np.argmax(f32.forward_all(seq), axis=-1)[len(prompt) - 1 : -1]
    got = np.argmax(q8.forward_all(seq), axis=-1)[len(prompt) - 1 : -1]
    assert ref.size == 64
    agree = float(np.mean(ref == got))
    print(f"q8 top-1 agreement {agree:.3f}")
    assert agree >= 0.95


def test_q4_error_report_is_sane(ckpts, tmp_path):
    # the Loom bake itself (calibrate=False): q4 from a snapshot is the calibrated recipe now
    report = convert(
        ckpts["qwen3"], tmp_path / "q4.entity", quant="q4", verify=True, calibrate=False
    )
    print(report.format())
    mats = report.matrices()
    assert mats and report.verified and not report.exact
    # Loom Q4_0 step is max|w|/7 per 32-block: Gaussian weights give ~10 % relative RMS error.
    for t in mats:
        if t.name.startswith("blocks."):
            assert 0 < t.rel_rms < 0.15, t
    vectors = [t for t in report.tensors if len(t.shape) == 1]
    assert vectors and all(t.exact for t in vectors)  # biases and norms stay float32
    ef = EntityFile(tmp_path / "q4.entity")
    assert all(rec.offset % 64 == 0 for rec in ef.blobs.values())
    assert ef.blobs["blocks.0.attn.w_q.packed"].dtype == "uint8"
    # q4 files keep the embeddings / tied LM head at 8 bits (int8 codes + per-row scales)
    assert ef.blobs["embeddings.codes"].dtype == "int8"
    assert ef.blobs["embeddings.scales"].dtype == "float32"


def test_self_contained_after_source_deleted(tmp_path):
    import tokenizers

    src = make_tiny_checkpoint(tmp_path / "snap", "llama", seed=7)
    tok_ref = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    jinja = src / "chat_template.jinja"  # transformers >= 4.43 writes the template here
    template = jinja.read_text() if jinja.is_file() else (src / "tokenizer_config.json").read_text()
    out = tmp_path / "m.entity"
    convert(src, out, quant="q4")
    shutil.rmtree(src)
    tf = load_entity(out)
    text = "hello world, héllo"
    assert tf.tokenizer.encode(text) == tok_ref.encode(text, add_special_tokens=False).ids
    assert tf.chat_template is not None and tf.chat_template.source.strip() == template.strip()
    assert tf.eos_token_ids
    done = tf.generate(IDS[:3], max_tokens=6, temperature=0.0)
    assert len(done.tokens) >= 1


@pytest.fixture(scope="module")
def q4_file(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "m.entity"
    convert(ckpts["qwen2"], out, quant="q4")
    return out


def test_random_byte_flips_never_load(q4_file, tmp_path):
    data = q4_file.read_bytes()
    hlen = int.from_bytes(data[12:20], "little")
    rng = random.Random(11)
    # Half of the positions in the prefix + header, half in the blob region.
    positions = [rng.randrange(0, 20 + hlen) for _ in range(100)]
    positions += [rng.randrange(20 + hlen, len(data)) for _ in range(100)]
    bad = tmp_path / "bad.entity"
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= rng.randrange(1, 256)
        bad.write_bytes(bytes(flipped))
        with pytest.raises((IntegrityError, EntityFormatError)):
            load_entity(bad)


def test_random_truncations_are_format_errors(q4_file, tmp_path):
    data = q4_file.read_bytes()
    rng = random.Random(3)
    bad = tmp_path / "cut.entity"
    for n in [0, 7, 20, 100] + [rng.randrange(0, len(data)) for _ in range(30)]:
        bad.write_bytes(data[:n])
        with pytest.raises(EntityFormatError):
            load_entity(bad)


def test_existing_and_bad_output_paths(ckpts, q4_file, tmp_path):
    before = q4_file.read_bytes()
    with pytest.raises(OutputExistsError):
        convert(ckpts["qwen2"], q4_file, quant="q4")
    assert q4_file.read_bytes() == before
    with pytest.raises(OutputPathError):
        convert(ckpts["qwen2"], tmp_path / "missing" / "x.entity")
    with pytest.raises(OutputPathError):
        convert(q4_file, q4_file, quant="f32", force=True)  # never over its own input
    assert q4_file.read_bytes() == before
    report = convert(q4_file, tmp_path / "again.entity", quant="q4", verify=True)
    assert report.verified and report.source_format == "entity"  # .entity -> .entity works


def test_sigkill_leaves_nothing_or_a_complete_file(tmp_path):
    src = make_tiny_checkpoint(
        tmp_path / "snap", "llama", config_overrides={"num_hidden_layers": 8}
    )
    out = tmp_path / "out" / "m.entity"
    out.parent.mkdir()
    code = f"from entity.convert import convert; convert({str(src)!r}, {str(out)!r}, quant='q4')"
    env = dict(os.environ, **{DELAY_ENV: "0.15"})
    rng = random.Random(5)
    outcomes = {"absent": 0, "complete": 0}
    for _ in range(10):
        if out.exists():
            out.unlink()
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
        time.sleep(rng.uniform(0.2, 2.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            load_entity(out, verify=True)  # complete and valid
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
    print(outcomes)
    # A clean run afterwards sweeps the temp files the killed writers left behind (once they
    # are STALE_MIN_AGE_S old and unlocked).
    if out.exists():
        out.unlink()
    time.sleep(STALE_MIN_AGE_S)
    convert(src, out, quant="q4")
    assert [p.name for p in out.parent.iterdir()] == ["m.entity"]


@pytest.mark.real_model
def test_q4_smollm2_rss_stays_near_file_size(smollm2_gguf, tmp_path):
    out = tmp_path / "smol-q4.entity"
    convert(smollm2_gguf, out, quant="q4")
    size = out.stat().st_size
    # VmHWM, not getrusage's ru_maxrss: Linux carries the parent's (pytest + torch) high-water
    # mark across fork+exec into ru_maxrss, while VmHWM belongs to the child's own address space.
    code = textwrap.dedent(f"""
        from entity.dotentity.read import load_entity
        tf = load_entity({str(out)!r}, max_seq_len=512)
        tf.forward(tf.tokenizer.encode("The sky is"))
        status = open("/proc/self/status").read()
        print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rss = int(res.stdout.strip().splitlines()[-1])
    print(f"file {size / 2**20:.1f} MiB, peak RSS {rss / 2**20:.1f} MiB")
    assert rss < size + 150 * 2**20
