"""`lucy serve` driven over real HTTP by the official `openai` client (tiny random model)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import KEY, env, get, lucy_generate, metrics, post, running_server  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("serve") / "tiny-llama", "llama", seed=5,
        config_overrides={"max_position_embeddings": 4096},
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt, "--max-batch", "4") as (base, proc):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


MODEL = "tiny-llama"


def _chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
    return client.chat.completions.create(model=MODEL, **kw)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert get(server + "/health", None) == (200, b'{"status":"ok"}')


def test_chat_page_is_served_offline(server):
    """GET / is the chat page (no key needed, it asks for one); its script and style come from
    the server itself and nothing in them points elsewhere (it must work offline)."""
    import re
    import urllib.request

    def fetch(path):
        with urllib.request.urlopen(server + path, timeout=10) as r:
            return r.status, r.headers, r.read().decode()

    status, headers, html = fetch("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert re.findall(r'(?:src|href)="(/[^"]+)"', html) == ["/static/chat.css", "/static/chat.js"]
    texts = [html]
    for path, kind in (("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
        status, headers, text = fetch(path)
        assert status == 200 and headers["content-type"].startswith(kind)
        texts.append(text)
    for text in texts:  # no URL of another host, no imported style sheet or font
        assert not re.search(r"https?://|@import|url\(|@font-face", text)
    code, body = get(server + "/static/nope.js", None)
    assert code == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_chat_greedy_equals_lucy_generate(ckpt, client):
    ref = lucy_generate(ckpt, PROMPT, 12, chat=True)
    r = _chat(client, max_tokens=12, temperature=0, logprobs=True)
    ch = r.choices[0]
    assert ch.message.content == ref["text"]
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == len(ref["tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(ch.logprobs.content) == len(ref["tokens"])
    assert ch.finish_reason == {"eos": "stop", "max_tokens": "length"}[ref["stop_reason"]]


def test_completion_greedy_equals_lucy_generate(ckpt, client):
    ref = lucy_generate(ckpt, PROMPT, 16, chat=False)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.usage.completion_tokens == len(ref["tokens"])
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["tokens"])


def test_chat_stream_equals_non_stream(client):
    full = _chat(client, max_tokens=10, temperature=0)
    chunks = list(_chat(client, max_tokens=10, temperature=0, stream=True,
                        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[4:6]
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    kw = dict(max_tokens=12, temperature=1.0, seed=1234, n=2)
    a, b = _chat(client, **kw), _chat(client, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens
    other = _chat(client, **{**kw, "seed": 99, "n": 1})
    assert len(a.choices) == 2 and other.choices[0].message.content is not None


def test_logprobs_shape(client):
    r = _chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the top one
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    c = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    assert len(c.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)


def test_errors_are_openai_shaped(server, client):
    url = server + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", 400, "invalid_json"),
        (json.dumps({"messages": msgs, "max_tokens": "ten"}).encode(), 400, None),
        (json.dumps({"messages": "hi"}).encode(), 400, None),
        (json.dumps({"messages": msgs, "temperature": -1}).encode(), 400, None),
        (json.dumps({"messages": msgs, "model": "nope"}).encode(), 404, "model_not_found"),
        (json.dumps({"messages": [{"role": "user", "content": "x " * 20000}]}).encode(), 400,
         "context_length_exceeded"),
        (b'{"messages": [], "pad": "' + b"x" * (10 << 20) + b'"}', 413, "body_too_large"),
        (b"[1, 2]", 400, None),
    ]  # fmt: skip
    for body, status, code in cases:
        got, data = post(url, body)
        assert got == status, (body[:60], data)
        err = data["error"]
        assert (
            set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
        )
        if code:
            assert err["code"] == code
    assert post(url, json.dumps({"messages": msgs}).encode(), key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=100)


def test_disconnect_cancels_and_frees(server, client):
    before = metrics(server)["poly_requests_cancelled_total"]
    stream = _chat(client, max_tokens=4000, temperature=0.8, seed=1, stream=True,
                   extra_body={"ignore_eos": True})  # far longer than the client stays  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    for _ in range(600):  # bounded polling, no timing claim
        m = metrics(server)
        if m["poly_requests_cancelled_total"] > before and m["poly_kv_sequences"] == 0:
            break
        time.sleep(0.1)
    assert m["poly_requests_cancelled_total"] == before + 1
    assert m["poly_kv_sequences"] == 0 and m["poly_batch_rows"] == 0


def test_metrics_text(server, client):
    _chat(client, max_tokens=3, temperature=0)
    status, body = get(server + "/metrics")
    assert status == 200
    text = body.decode()
    assert "# TYPE poly_requests_total counter" in text
    m = metrics(server)
    assert m["poly_generation_tokens_total"] >= 3 and m["poly_queue_length"] == 0


def test_sigterm_drains_streams_and_exits_0(ckpt):
    with running_server(ckpt) as (base, proc):
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        stream = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0,
                                      stream=True)  # fmt: skip
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert proc.wait(60) == 0
    assert first.choices[0].text is not None
    assert rest[-1].choices[0].finish_reason == "length"
    assert 1 + len(rest) == 60


def test_open_host_without_key_warns(tmp_path):
    cmd = [sys.executable, "-m", "lucy", "serve", str(tmp_path / "missing"), "--host", "0.0.0.0"]
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0
    assert len([ln for ln in lines if "warning" in ln and "--api-key" in ln]) == 1
