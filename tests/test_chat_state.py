"""A saved conversation (ChatSession.save / load, `lucy chat` /save FILE and /load FILE) on a tiny
random llama (tests/hf_fixtures): restored in a new model (and a new `lucy chat` process), the
next reply is transformers' greedy reply to the whole rendered conversation, and only the new
message is prefilled; bad files and other models' states are one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

import entity
from poly.errors import ModelBusyError, StateFileError
from poly.text.session import ChatSession
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint

N = 10


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("chatstate"), "llama", seed=6)


def _reply(session, text):
    stream = session.send(text)
    for _ in stream:
        pass
    return stream.state.done


def _hf_reply(snap, messages) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(snap))
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = list(ids)
    return hf_greedy(snap, ids, N), len(ids)


def test_restored_chat_continues_as_transformers(snap, tmp_path):
    first = ChatSession(entity.load(snap), system="be brief", temperature=0.0, max_tokens=N)
    one = _reply(first, "hello there")
    first.save(tmp_path / "c.kv")
    second = ChatSession(entity.load(snap), temperature=0.0, max_tokens=N)
    assert second.load(tmp_path / "c.kv") == 1
    assert second.history == first.history
    two = _reply(second, "and again")
    msgs = first.history + [{"role": "user", "content": "and again"}]
    want, n_ids = _hf_reply(snap, msgs)
    assert list(two.tokens) == want[: len(two.tokens)]
    assert two.stop_reason == "eos" or len(two.tokens) == N
    assert 0 < two.prefill_tokens < n_ids - len(one.tokens)  # the cache served the rest


def test_sampled_chat_continues_its_random_stream(snap, tmp_path):
    """The sampler's random state travels with the file: a sampled second reply after /load is
    the one the first session draws (a fresh seed would draw another)."""
    opts = {"temperature": 1.5, "top_k": 0, "seed": 11, "max_tokens": N}
    first = ChatSession(entity.load(snap), **opts)
    _reply(first, "hello there")
    first.save(tmp_path / "r.kv")
    want = _reply(first, "and again").tokens
    second = ChatSession(entity.load(snap), **opts)
    second.load(tmp_path / "r.kv")
    assert _reply(second, "and again").tokens == want
    third = ChatSession(entity.load(snap), **opts)  # the same seed, not restored
    third.load(tmp_path / "r.kv")
    third._sampler = None
    assert _reply(third, "and again").tokens != want


def test_bad_chat_states(snap, tmp_path):
    model = entity.load(snap)
    model.forward([5, 6, 7])
    model.save_state(tmp_path / "plain.kv")  # a state with no conversation in it
    session = ChatSession(entity.load(snap), temperature=0.0, max_tokens=N)
    with pytest.raises(StateFileError, match="no chat"):
        session.load(tmp_path / "plain.kv")
    assert _reply(session, "hi").tokens  # still usable: the next turn prefilled from scratch
    stream = session.send("more")
    next(stream)  # a reply in flight holds the model
    with pytest.raises(ModelBusyError):
        session.save(tmp_path / "busy.kv")
    stream.close()
    assert not (tmp_path / "busy.kv").exists()


def _chat(snap, stdin: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lucy", "chat", str(snap), "--temperature", "0"]
    cmd += ["--max-tokens", str(N)]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def test_lucy_chat_save_load_in_new_processes(snap, tmp_path):
    """The reply after /load in a second process is the one process's second reply."""
    from lucy.terminal import clean

    whole = ChatSession(entity.load(snap), temperature=0.0, max_tokens=N)
    _reply(whole, "hello there")
    want = "bot> " + clean(_reply(whole, "and again").text)
    state = tmp_path / "chat.kv"
    saved = _chat(snap, f"hello there\n/save {state}\n")
    bad = f"/load {tmp_path / 'absent.kv'}\n/save\n/load {snap / 'config.json'}\n"
    restored = _chat(snap, f"{bad}/load {state}\nand again\n")
    for run in (saved, restored):
        assert run.returncode == 0, run.stderr
    assert f"to {state}" in saved.stdout and "loaded 1 turns" in restored.stdout
    assert restored.stdout.count("bot> ") == 1 and want + "\n" in restored.stdout
    errors = [line for line in restored.stdout.splitlines() if "error: " in line]
    assert len(errors) == 3
    assert "no such state file" in errors[0] and "usage: /save FILE" in errors[1]
    assert "not a state file" in errors[2]
