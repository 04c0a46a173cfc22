"""`lucy serve` and `lucy chat` run a tiny model of each issue-58 family (acceptance 4): a real
server on a loopback port answers a greedy completion (the official openai client) with
transformers' greedy tokens, and `lucy chat` fed one line on stdin replies with transformers'
greedy reply to the chat template's rendering."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from entity.families import FAMILIES
from tests import hf_fixtures
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint
from tests.serve_helpers import KEY, env, running_server
from tests.test_tp_families import CASES

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

PROMPT = "The quick brown fox"
USER = "Hello there"
N = 8
MOE = ("olmoe", "granitemoe", "gpt_oss")  # hf_fixtures' own configs
FAST = ("gemma2",)  # the rest are slow: a server and a chat process each (~20 s)
FAMILY_LIST = [f for f in (*CASES, *MOE) if f in FAMILIES]


def _params():
    return [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILY_LIST]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families_serve")


def _checkpoint(root: Path, family: str) -> Path:
    path = root / family
    if not path.is_dir():
        if family in CASES:
            cls, causal, keys, tied = CASES[family]
            hf_fixtures._ARCH_CONFIG[f"tp_{family}"] = (cls, causal, keys)
            make_tiny_checkpoint(path, f"tp_{family}", tied=tied, seed=11)
        else:
            make_tiny_checkpoint(path, family, seed=11)
    return path


def _until_eos(tokens: list[int]) -> list[int]:
    """The reply a server or chat returns: up to the end-of-turn / EOS token (its stop id)."""
    eos = hf_fixtures.EOS_ID
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.parametrize("family", _params())
def test_lucy_serve_completion_is_transformers_greedy(root, family):
    from transformers import AutoTokenizer

    path = _checkpoint(root, family)
    tok = AutoTokenizer.from_pretrained(path)
    full = hf_greedy(path, tok(PROMPT)["input_ids"], N)
    want = _until_eos(full)
    with running_server(path) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = client.completions.create(model=family, prompt=PROMPT, max_tokens=N, temperature=0)
    stopped = len(want) < len(full)  # the EOS token counts as generated
    assert r.choices[0].finish_reason == ("stop" if stopped else "length")
    assert r.usage.completion_tokens == len(want) + stopped
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("family", _params())
def test_lucy_chat_reply_is_transformers_greedy(root, family):
    from transformers import AutoTokenizer

    path = _checkpoint(root, family)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": USER}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)  # fmt: skip
    want = _until_eos(hf_greedy(path, list(ids), N))
    cmd = [sys.executable, "-m", "lucy", "chat", str(path), "--temperature", "0"]
    out = subprocess.run(cmd + ["--max-tokens", str(N)], input=USER + "\n", capture_output=True,
                         text=True, env=env(), timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # the chat writes special tokens as their text and drops terminal control characters
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", tok.decode(want))
    assert "bot> " + text + "\n" in out.stdout
