"""`lucy serve --lookup N` / `--draft MODEL`: greedy replies through the official openai client equal
a plain server's, and /metrics reports the acceptance rate and tokens per pass (tiny model)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import KEY, metrics, running_server  # noqa: E402

MODEL = "tiny-spec"
# text that repeats itself (prompt lookup finds its n-grams) and text that does not
PROMPTS = [
    "one two three four one two three four one two three",
    "def add(x, y):\n    return x + y\n\ndef add(x, y):\n    return",
    "The quick brown fox",
    "a b c d e f g a b c d e f g a b c",
    "Hello world! Hello world! Hello",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / MODEL, "llama", seed=0)


def _replies(base) -> list[tuple[str, str]]:
    c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    out = []
    for p in PROMPTS:
        done = c.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                         max_tokens=24, temperature=0, stream=True)  # fmt: skip
        text = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)
        out.append((done.choices[0].text, text))
    return out


@pytest.fixture(scope="module")
def plain(ckpt):
    with running_server(ckpt) as (base, _):
        return _replies(base)


def test_measured_speculation_gives_the_same_replies(ckpt, plain):
    """Without --spec-always a pass that costs more seconds per token than plain steps turns
    speculation off for a while: the replies stay the plain ones either way."""
    with running_server(ckpt, "--lookup", "8") as (base, _):
        got = _replies(base)
        m = metrics(base)
    assert got == plain
    assert m["poly_spec_checks_total"] > 0


@pytest.mark.parametrize("how", ["lookup", "draft"])
def test_greedy_replies_equal_plain_decoding(ckpt, plain, how):
    # the draft: another copy of the same weights (every proposal is the model's own choice)
    args = ("--lookup", "8") if how == "lookup" else ("--draft", str(ckpt), "--draft-tokens", "6")
    args += ("--spec-always",)  # every lone step checks proposals, however the machine's load
    with running_server(ckpt, *args) as (base, _):
        got = _replies(base)
        m = metrics(base)
    assert got == plain
    assert m["poly_spec_checks_total"] > 0
    assert m["poly_spec_accepted_tokens_total"] > 0
    rate = m["poly_spec_accepted_tokens_total"] / m["poly_spec_proposed_tokens_total"]
    assert m["poly_spec_acceptance_rate"] == pytest.approx(rate, abs=1e-5)
    assert m["poly_spec_tokens_per_pass"] > 1.0  # more than one token per pass over the weights
    if how == "draft":
        assert m["poly_spec_acceptance_rate"] > 0.9  # its own weights: all but near-ties agree


def test_bad_speculation_options_are_one_line_errors(ckpt):
    import subprocess
    import sys

    from tests.serve_helpers import env

    for args in (["--lookup", "0"], ["--lookup", "40"], ["--lookup", "4", "--draft", str(ckpt)],
                 ["--draft-tokens", "4"]):  # fmt: skip
        cmd = [sys.executable, "-m", "lucy", "serve", str(ckpt), "--port", "0", *args]
        r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
