"""`lucy generate` / `lucy chat` / `lucy bench` with --lookup, --draft, --draft-tokens, as
subprocesses on a tiny random llama (tests/hf_fixtures): the greedy tokens equal plain
decoding's, bad values are one line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.hf_fixtures import VOCAB, make_tiny_checkpoint

PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    base = tmp_path_factory.mktemp("speccli")
    gen = {"max_new_tokens": 12, "do_sample": False}
    model = make_tiny_checkpoint(base / "m", "llama", seed=0, generation=gen)
    other = make_tiny_checkpoint(base / "v", "llama", seed=1, config_overrides={"vocab_size": VOCAB + 8})  # fmt: skip
    return model, other


def lucy(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lucy", *map(str, args)],
        capture_output=True, text=True, timeout=300, input=stdin,
    )  # fmt: skip


def test_generate_lookup_and_draft_give_the_plain_tokens(snaps):
    model, _ = snaps
    base = ("generate", model, "--prompt", PROMPT, "--greedy", "--max-tokens", 12, "--json")
    runs = [lucy(*base, *extra) for extra in ((), ("--lookup", 4), ("--draft", model))]
    outs = [json.loads(r.stdout) for r in runs]
    assert all(r.returncode == 0 for r in runs)
    assert outs[1]["tokens"] == outs[0]["tokens"] == outs[2]["tokens"]
    assert "speculative" not in outs[0]
    assert outs[1]["speculative"]["mode"] == "lookup"
    assert outs[2]["speculative"]["accepted"] > 0  # the same weights: the draft agrees
    verbose = lucy(*base[:-1], "--lookup", 4, "--verbose")
    assert verbose.returncode == 0 and "speculative (lookup): accepted" in verbose.stderr


def test_chat_footer_and_bench_json_show_the_acceptance(snaps):
    model, _ = snaps
    chat = lucy("chat", model, "--lookup", 5, "--temperature", 0, stdin="hello hello\nagain\n")
    assert chat.returncode == 0 and chat.stdout.count("tok/pass") == 2
    bench = lucy("bench", model, "--lookup", 4, "--json", "--runs", 1, "--new-tokens", 8)
    spec = json.loads(bench.stdout)["speculative"]
    assert spec["same_tokens"] is True and spec["decode_tok_s"] > 0 and "acceptance_rate" in spec


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--lookup", 0), "--lookup must be an integer in 1..63"),
        (("--lookup", 64), "--lookup must be an integer in 1..63"),
        (("--draft-tokens", 3), "--draft-tokens needs --draft MODEL"),
        (("--lookup", 3, "--draft", "X"), "choose one way"),
        (("--draft", "OTHER", "--draft-tokens", 65), "--draft-tokens must be an integer in 1..63"),
        (("--draft", "OTHER"), "draft vocabulary 308 != the model's 300"),
    ],
)
def test_bad_speculation_flags_are_one_line_exit_2(snaps, extra, message):
    model, other = snaps
    extra = [other if a == "OTHER" else a for a in extra]
    for cmd in ("generate", "chat"):
        args = [cmd, model, *extra] + (["--prompt", "hi"] if cmd == "generate" else [])
        res = lucy(*args, stdin="hi\n")
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lucy: error: ") and message in lines[0]
