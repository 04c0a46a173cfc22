"""The `lucy` menu driven through a pseudo-terminal (pexpect) and through piped stdin.

The chat walk checks KV-cache reuse from the outside: turn 2's "prefill N tok" footer must equal
the tokens of the re-rendered conversation that are not already cached, computed here with
transformers' tokenizer and transformers' own greedy reply to turn 1.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pexpect
import pytest

from lucy import layer_suite
from tests.test_lucy_cli import world  # noqa: F401 - the shared fabricated HF cache fixture

U1, U2 = "hello there", "tell me more"
MENU = "Select [1]: "
FOOTER = re.compile(r"prefill (\d+) tok")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_prefills(src) -> tuple[int, int, int]:
    """(turn-1 prompt length, turn-2 new-segment length, turn-2 full conversation length).

    The cache after turn 1 holds the prompt and every reply token but the last (which was
    sampled, never fed back); turn 2 must prefill only what follows the common prefix.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(src)
    model = LlamaForCausalLM.from_pretrained(src)
    msgs1 = [{"role": "user", "content": U1}]
    f1 = tok.apply_chat_template(msgs1, add_generation_prompt=True, tokenize=False)
    ids1 = tok(f1, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids1]), max_new_tokens=6, do_sample=False)
    reply = out[0, len(ids1) :].tolist()
    text = tok.decode(reply, skip_special_tokens=True)
    msgs2 = msgs1 + [{"role": "assistant", "content": text}, {"role": "user", "content": U2}]
    f2 = tok.apply_chat_template(msgs2, add_generation_prompt=True, tokenize=False)
    ids2 = tok(f2, add_special_tokens=False)["input_ids"]
    cached = ids1 + reply[:-1]
    return len(ids1), len(ids2) - common_prefix(ids2, cached), len(ids2)


def spawn(world):  # noqa: F811
    env = {**world["env"], "TERM": "xterm"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "lucy"],
        env=env,
        cwd=str(world["base"]),
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 200),
    )
    return child


def read_footer(child) -> int:
    child.expect(FOOTER)
    return int(child.match.group(1))


def test_menu_chat_walk_in_a_terminal(world):  # noqa: F811
    p1_ref, p2_ref, full2 = expected_prefills(world["src"])
    child = spawn(world)
    child.expect_exact(MENU)
    assert "[7] Demo (SmolLM2-135M)" in ANSI.sub("", child.before)
    child.sendline("1")
    child.expect_exact("Select model number [1]: ")
    child.sendline("")
    child.expect_exact("you> ")
    child.sendline(U1)
    p1 = read_footer(child)
    child.expect_exact("you> ")
    child.sendline(U2)
    p2 = read_footer(child)
    child.expect_exact("you> ")
    child.sendline("/reset")
    child.expect_exact("conversation reset")
    child.expect_exact("you> ")
    child.sendline("/quit")
    child.expect_exact(MENU)
    child.sendline("0")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert p1 == p1_ref
    assert p2 < full2
    assert p2 == p2_ref


def test_menu_chat_walk_piped(world):  # noqa: F811
    p1_ref, p2_ref, _ = expected_prefills(world["src"])
    script = f"1\n\n{U1}\n{U2}\n/stats\n/reset\n/quit\n0\n"
    proc = subprocess.run(
        [sys.executable, "-m", "lucy"],
        input=script,
        env=world["env"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=world["base"],
    )
    assert proc.returncode == 0, proc.stderr
    footers = [int(m) for m in FOOTER.findall(proc.stdout)]
    assert footers[:2] == [p1_ref, p2_ref], proc.stdout
    assert "\x1b[" not in proc.stdout  # no cursor or colour codes when stdout is not a terminal
    assert "conversation reset" in proc.stdout


@pytest.mark.parametrize(
    "typed",
    ["", "1\n", "1\n\n", f"1\n\n{U1}\n", "2\n", "2\n0\n", "3\n", "4\n", "4\n\n", "5\n", "9\n"],
)
def test_eof_at_every_prompt_exits_zero(world, typed):  # noqa: F811
    proc = subprocess.run(
        [sys.executable, "-m", "lucy"],
        input=typed,
        env=world["env"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=world["base"],
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_unknown_choice_reasks(world):  # noqa: F811
    proc = subprocess.run(
        [sys.executable, "-m", "lucy"],
        input="x\n42\n0\n",
        env=world["env"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=world["base"],
    )
    assert proc.returncode == 0
    assert proc.stdout.count(MENU) == 3


# --- the layer suite (menu [6]) ---------------------------------------------------------------


def test_layer_suite_buckets_follow_loom():
    assert layer_suite.bucket(0.0, 1e-3) == "EXACT"
    assert layer_suite.bucket(5e-4, 1e-3) == "INDUSTRY"
    assert layer_suite.bucket(5e-3, 1e-3) == "LOWBIT"
    assert layer_suite.bucket(0.05, 1e-3) == "DRIFT"
    assert layer_suite.bucket(0.5, 1e-3) == "HEAVY DRIFT"
    assert layer_suite.bucket(3.0, 1e-3) == "BROKEN"
    assert layer_suite.bucket(math.nan, 1e-3) == "FATAL"


def test_layer_suite_rmsnorm_float16_matches_numpy():
    """The f16 RMSNorm row equals a numpy RMSNorm with the gamma rounded to float16."""
    rows = layer_suite.run_suite(dtypes=[layer_suite.DType.FLOAT32, layer_suite.DType.FLOAT16])
    assert len(rows) == 6
    f32 = {r.layer: r for r in rows if r.dtype == "float32"}
    assert all(r.bucket == "EXACT" for r in f32.values())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((layer_suite.SEQ, layer_suite.D_MODEL)).astype(np.float32)
    gamma = (1.0 + 0.1 * rng.standard_normal(layer_suite.D_MODEL)).astype(np.float32)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6))
    ref_diff = np.max(np.abs(normed * gamma.astype(np.float16).astype(np.float32) - normed * gamma))
    row = next(r for r in rows if r.layer == "RMSNorm" and r.dtype == "float16")
    assert row.max_diff == pytest.approx(float(ref_diff), rel=1e-3, abs=1e-6)
    assert row.bucket == layer_suite.bucket(row.max_diff, 1e-3)


def test_context_overflow_offers_to_drop_oldest_turn(world):  # noqa: F811
    """A turn that does not fit: Lucy drops turn 1 (--on-full drop-oldest), then prefills only past the shared
    template prefix (the cache still holds turn 1's tokens)."""
    from transformers import AutoTokenizer

    first = "The quick brown fox jumps over the lazy dog. " * 5
    second = "Hello world! " * 20
    script = f"{first}\n{second}\n/quit\n"  # piped: the policy flag answers, not a line (#18)
    proc = subprocess.run(
        [sys.executable, "-m", "lucy", "chat", str(world["snapshot"]), "--on-full", "drop-oldest"],
        input=script,
        env=world["env"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=world["base"],
    )
    assert proc.returncode == 0, proc.stderr
    assert "context full" in proc.stdout
    tok = AutoTokenizer.from_pretrained(world["src"])

    def ids(text):
        msgs = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tok(rendered, add_special_tokens=False)["input_ids"]

    ids1, ids2 = ids(first.strip()), ids(second.strip())  # the chat strips each input line
    assert len(ids1) + len(ids2) + 6 > 256  # the fixture's context: turn 2 cannot fit unaided
    footers = [int(m) for m in FOOTER.findall(proc.stdout)]
    assert footers == [len(ids1), len(ids2) - common_prefix(ids2, ids1)]


def test_ctrl_c_at_chat_prompt_returns_to_menu(world):  # noqa: F811
    child = spawn(world)
    child.expect_exact(MENU)
    child.sendline("1")
    child.expect_exact("Select model number [1]: ")
    child.sendline("")
    child.expect_exact("you> ")
    child.sendintr()
    child.expect_exact(MENU)
    child.sendline("0")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_commands_piped(world):  # noqa: F811
    """/set validates (bad value: one error line, chat goes on), /system restarts the
    conversation: the next turn's prefill is the full system + user rendering."""
    from transformers import AutoTokenizer

    script = (
        "\n/help\n/set temperature x\n/set bogus 1\n/set top_k 5\n/frob\n"
        "/system You are terse.\nhello there\n/quit\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "lucy", "chat", str(world["snapshot"]), "--temperature", "0"],
        input=script,
        env=world["env"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=world["base"],
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "/system TEXT" in out  # the help text
    assert "'x' is not a valid float" in out
    assert "usage: /set NAME VALUE" in out
    assert "top_k = 5" in out
    assert "unknown command '/frob'" in out
    tok = AutoTokenizer.from_pretrained(world["src"])
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": U1}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    n = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert [int(m) for m in FOOTER.findall(out)] == [n]


def test_non_utf8_input_does_not_crash(world):  # noqa: F811
    proc = subprocess.run(
        [sys.executable, "-m", "lucy", "chat", str(world["snapshot"]), "--max-tokens", "2"],
        input=b"hel\xff\xfelo\n/quit\n",
        env=world["env"],
        capture_output=True,
        timeout=240,
        cwd=world["base"],
    )
    assert proc.returncode == 0, proc.stderr
    assert FOOTER.search(proc.stdout.decode("utf-8", "replace"))
