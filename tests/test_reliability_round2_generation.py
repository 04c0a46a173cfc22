"""Reliability round 2 (issue #18), generation and the CLI (items 7, 9, 10): one test (or more) per item, reproducing the
reported input. Memory bounds are the peak RSS of a child process (`tests.round2_support`),
generous for a loaded machine; no test asserts a tight wall-clock time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.round2_support import REPO, lucy, one_error_line

pytestmark = pytest.mark.timeout(300)


# --- item 7: tiny temperature / repetition penalty -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from tests.fuzz.corpus import byte_vocab, gguf_model

    p = tmp_path_factory.mktemp("r2gguf") / "tiny.gguf"
    p.write_bytes(gguf_model(tokens=byte_vocab(), hidden=32))
    return p


def test_item7_tiny_temperature_and_penalty_compute_safely():
    import warnings

    import numpy as np

    from poly.text.sampling import GenOptions, Sampler

    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, 258).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning either
        for t in (1e-40, 1e-6, 5e-324):
            s = Sampler(GenOptions(temperature=t, seed=1), 258)
            assert s.sample(logits) == int(np.argmax(logits))  # the T -> 0 limit
        for pen in (1e-40, 1e-30, 1e30):
            s = Sampler(GenOptions(temperature=0.7, repetition_penalty=pen, seed=1), 258)
            p = s.probabilities(logits, tokens=list(range(0, 258, 3)))
            assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9
            s.sample(logits, tokens=list(range(0, 258, 3)))
        opts = GenOptions(temperature=1e-3, banned_tokens=(5,), top_k=0, top_p=1.0, min_p=0.0)
        x = Sampler(opts, 258).process(logits)
        assert x[5] == -np.inf and np.isfinite(np.delete(x, 5)).all()  # masks stay masked


def test_item7_cli_generate_with_temperature_1e_40(tiny_gguf):
    import json

    args = ("generate", tiny_gguf, "--prompt", "ab", "--max-tokens", "4", "--json")
    code, out, err, _ = lucy(*args, "--temperature", "1e-40")
    assert code == 0 and err == "", err  # was a bare ValueError and a RuntimeWarning
    code0, out0, _, _ = lucy(*args, "--temperature", "0")
    assert code0 == 0 and json.loads(out)["tokens"] == json.loads(out0)["tokens"]  # greedy


def test_item7_chat_set_tiny_temperature_keeps_the_chat(tiny_gguf):
    code, out, err, _ = lucy(
        "chat",
        tiny_gguf,
        "--max-tokens",
        "3",
        stdin="/set temperature 1e-40\nhello\nagain\n/stats\n/quit\n",
    )
    assert code == 0, err
    assert "Traceback" not in err and "turns" in out  # /stats ran after both turns


def test_item7_failed_turn_is_not_recorded(tmp_path, monkeypatch):
    from poly.text.sampling import GenOptions, Sampler
    from poly.text.session import ChatSession
    from tests.fuzz.corpus import tiny_model

    tf = tiny_model(tmp_path, hidden=32)
    session = ChatSession(tf, options=GenOptions(temperature=0.8, seed=2, max_tokens=3))
    "".join(e.text for e in session.send("first") if hasattr(e, "text"))
    assert session.turns == 1

    def broken(self, *a, **k):
        raise ValueError("a bug outside the typed errors")

    monkeypatch.setattr(Sampler, "sample", broken)
    with pytest.raises(ValueError):
        list(session.send("second"))
    assert session.turns == 1 and [m["content"] for m in session.history] == [
        "first", session.history[1]["content"]
    ]  # fmt: skip


# --- item 9: piped chat with a full context ------------------------------------------------------

_MESSAGES = [f"message number {i} is here" for i in range(8)]


def _piped_chat(tiny_gguf, *flags) -> tuple[int, str, str]:
    stdin = "\n".join([*_MESSAGES, "/stats", "/quit"]) + "\n"
    code, out, err, _ = lucy("chat", tiny_gguf, "--max-tokens", "4", *flags, stdin=stdin)
    return code, out, err


def test_item9_piped_chat_drop_oldest_loses_no_message(tiny_gguf):
    code, out, err = _piped_chat(tiny_gguf, "--on-full", "drop-oldest")
    assert code == 0, err
    assert out.count("bot> ") == len(_MESSAGES)  # every message answered (5 vanished before)
    assert "context full" in out and "(1/0)" not in out  # dropped, never asked
    assert "turns" in out  # /stats after the last message still ran
    assert "truncate" not in out + err


def test_item9_piped_chat_default_stops_with_exit_8(tiny_gguf):
    code, out, err = _piped_chat(tiny_gguf)
    assert code == 8, (out, err)
    assert "(1/0)" not in out and "truncate" not in out + err
    assert "message not sent; chat ended (--on-full stop)" in out
    assert 0 < out.count("bot> ") < len(_MESSAGES)


def test_item9_ask_needs_a_terminal(tiny_gguf):
    code, out, err = _piped_chat(tiny_gguf, "--on-full", "ask")
    assert code == 2 and "interactive terminal" in one_error_line(err)


# --- item 10: lucy generate strips terminal escape sequences on a terminal -----------------------

ESCAPES = [b"\x1b]0;TITLE\x07", b"\x1b[41m"]


def _byte_level(data: bytes) -> str:
    """GPT-2's bytes -> unicode map (the ByteLevel alphabet), as tokenizers applies it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return "".join(table[b] for b in data)


@pytest.fixture(scope="module")
def escape_gguf(tmp_path_factory) -> Path:
    """A vocabulary whose tokens (all but a, b and the markers) decode to escape sequences."""
    from tests.fuzz.corpus import byte_vocab, gguf_model

    toks = byte_vocab()
    for i, t in enumerate(toks[:-2]):
        if t not in ("a", "b"):
            toks[i] = _byte_level(ESCAPES[i % 2] + str(i).encode())
    p = tmp_path_factory.mktemp("r2esc") / "esc.gguf"
    p.write_bytes(gguf_model(tokens=toks, hidden=32))
    return p


def _generate_on_a_pty(model: Path) -> bytes:
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    argv = [sys.executable, "-m", "lucy", "generate", str(model), "--prompt", "ab"]
    p = subprocess.Popen(
        [*argv, "--max-tokens", "8"], stdout=slave, stderr=subprocess.PIPE, env=env
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.wait(timeout=120) == 0, p.stderr.read()
    return b"".join(chunks)


def test_item10_generate_strips_escapes_on_a_terminal(escape_gguf):
    args = ("generate", escape_gguf, "--prompt", "ab", "--max-tokens", "8")
    code, out, err, _ = lucy(*args, "--json")
    assert code == 0 and "\x1b" not in out and "\\u001b" in out  # emitted; escaped in JSON
    shown = _generate_on_a_pty(escape_gguf)
    assert b"\x1b" not in shown and b"\x07" not in shown, shown
    assert b"TITLE" in shown  # the text survives, the control bytes do not
    code, raw, err, _ = lucy(*args)
    assert code == 0 and "\x1b" not in raw and "TITLE" in raw  # piped: stripped too
