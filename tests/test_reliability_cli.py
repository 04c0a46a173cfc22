"""Reliability of the `lucy` CLI: every failure is one `lucy: error: ...` line on stderr and the
documented exit code (poly.errors.EXIT_CODES), never a traceback; interrupted runs leave no file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lucy.cli import run
from poly.errors import EXIT_CODES
from tests.fuzz.corpus import (
    STRING,
    entity_valid,
    gguf_model,
    gguf_model_parts,
    gguf_pack,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _cli(capfd, *argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("lucy: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from tests.fuzz.corpus import byte_vocab

    p = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    p.write_bytes(gguf_model(tokens=byte_vocab(), hidden=32))
    return p


CASES = [
    ("usage-unknown-command", ["frobnicate"], 2),
    ("usage-bad-choice", ["convert", "x", "--quant", "q3"], 2),
    ("usage-not-a-number", ["generate", "m", "--prompt", "x", "--temperature", "hot"], 2),
    ("B8-105-temperature", ["generate", "{gguf}", "--prompt", "x", "--temperature", "-1"], 2),
    ("B8-105-top-p", ["generate", "{gguf}", "--prompt", "x", "--top-p", "1.5"], 2),
    ("B8-105-top-k", ["generate", "{gguf}", "--prompt", "x", "--top-k", "-5"], 2),
    ("B8-105-max-tokens", ["generate", "{gguf}", "--prompt", "x", "--max-tokens", "0"], 2),
    ("B8-105-nan", ["generate", "{gguf}", "--prompt", "x", "--temperature", "nan"], 2),
    ("B1-1-missing", ["inspect", "{tmp}/nope.gguf"], 3),
    ("B1-3-empty", ["inspect", "{empty}"], 4),
    ("B1-4-pickle", ["inspect", "{pickle}"], 4),
    ("B5-bad-gguf", ["inspect", "{badgguf}"], 4),
    ("B6-bad-entity", ["inspect", "{badentity}"], 6),
    ("B8-102-context", ["generate", "{gguf}", "--prompt", "{long}", "--max-tokens", "4"], 8),
    ("B7-93-exists", ["convert", "{gguf}", "-o", "{exists}"], 7),
    ("B7-97-missing-dir", ["convert", "{gguf}", "-o", "{tmp}/no/such/dir/x.entity"], 9),
]


@pytest.mark.parametrize("argv,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_is_one_line_and_exit_code(capfd, tmp_path, tiny_gguf, argv, code):
    files = {
        "gguf": tiny_gguf,
        "tmp": tmp_path,
        "empty": tmp_path / "empty.gguf",
        "pickle": tmp_path / "model.safetensors",
        "badgguf": tmp_path / "bad.gguf",
        "badentity": tmp_path / "bad.entity",
        "exists": tmp_path / "exists.entity",
        "long": "a" * 100,
    }
    files["empty"].write_bytes(b"")
    files["pickle"].write_bytes(b"\x80\x04\x95\x00\x00")
    files["badgguf"].write_bytes(gguf_model()[:200])
    ent = entity_valid()
    files["badentity"].write_bytes(ent[:-1] + bytes([ent[-1] ^ 1]))  # checksum mismatch
    files["exists"].write_bytes(b"keep")
    got, out, err = _cli(capfd, *[a.format(**files) for a in argv])
    _one_error_line(err)
    assert got == code, (err, EXIT_CODES.get(code))
    assert files["exists"].read_bytes() == b"keep"


def test_b8_106_nan_weights_exit_8(capfd, tmp_path):
    from tests.fuzz.corpus import byte_vocab

    kvs, tensors = gguf_model_parts(tokens=byte_vocab(), hidden=32)
    tensors = [(n, t, d, np.full(len(r) // 4, np.nan, np.float32).tobytes() if n == "output_norm.weight" else r)
               for n, t, d, r in tensors]  # fmt: skip
    p = tmp_path / "nan.gguf"
    p.write_bytes(gguf_pack(kvs, tensors))
    code, out, err = _cli(capfd, "generate", p, "--prompt", "hello", "--max-tokens", "3")
    _one_error_line(err)
    assert code == 8


def test_message_with_newlines_stays_one_line(capfd, tmp_path):
    d = tmp_path / "a\nb\x1b[31m"
    d.mkdir()
    code, _, err = _cli(capfd, "inspect", d / "m.gguf")
    line = _one_error_line(err)
    assert code == 3 and "\n" not in line


def test_control_chars_in_metadata_never_reach_the_terminal(capfd, tmp_path):
    from tests.fuzz.corpus import byte_vocab

    p = tmp_path / "evil.gguf"
    evil = "\x1b]0;pwned\x07\x1b[2J name"
    p.write_bytes(gguf_model({"general.name": (STRING, evil)}, tokens=byte_vocab(), hidden=32))
    code, out, err = _cli(capfd, "inspect", p)
    assert code == 0, err
    assert "\x1b]0;" not in out and "\x07" not in out and "\x1b[2J" not in out
    code, out, err = _cli(capfd, "inspect", p, "--json")
    assert code == 0 and "\x1b" not in out  # JSON escapes it


def test_generate_valid_tiny_model_works(capfd, tiny_gguf):
    code, out, err = _cli(capfd, "generate", tiny_gguf, "--prompt", "hi", "--max-tokens", "3",
                          "--temperature", "0")  # fmt: skip
    assert code == 0, err


# --- real processes: no traceback, SIGINT, disk full, non-tty stdin ----------------------------


def _proc(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO), **kw.pop("env", {}))
    return subprocess.Popen([sys.executable, "-m", "lucy", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # fmt: skip


def test_process_bad_file_no_traceback(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + b"\xff" * 40)
    proc = _proc(["inspect", p])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4
    _one_error_line(err)


def test_b7_96_sigint_during_convert(tmp_path):
    from tests.hf_fixtures import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "llama", config_overrides={"num_hidden_layers": 8})
    out = tmp_path / "out" / "m.entity"
    out.parent.mkdir()
    proc = _proc(["convert", src, "-o", out], env={"POLY_CONVERT_BLOCK_DELAY": "0.5"})
    deadline = time.monotonic() + 60
    while not any(out.parent.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until the writer has started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    _one_error_line(err)
    assert list(out.parent.iterdir()) == []


def test_b7_94_disk_full_exit_9(tmp_path):
    from tests.hf_fixtures import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "llama")
    out = tmp_path / "out" / "m.entity"
    out.parent.mkdir()
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (50000, 50000)); "
        "from lucy.cli import run; sys.exit(run(sys.argv[1:]))"
    )
    res = subprocess.run([sys.executable, "-c", code, "convert", str(src), "-o", str(out), "--quant", "f32"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    _one_error_line(res.stderr)
    assert res.returncode == 9, res.stderr
    assert list(out.parent.iterdir()) == []


def test_menu_with_closed_stdin(tmp_path):
    proc = _proc([], stdin=subprocess.DEVNULL, env={"POLY_HOME": str(tmp_path)})
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "Traceback" not in out
    assert proc.returncode in (0, 1, 2, 130)
