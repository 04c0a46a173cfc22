"""The chat page of `lucy serve` (GET /) in a real browser: Debian's Chromium driven by
Playwright, against a real server on the real SmolLM2-135M-Instruct (slow: CI runs them)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from playwright.sync_api import sync_playwright  # noqa: E402

from tests.serve_helpers import KEY, ROOT, get, metrics, post, running_server  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
# no network beyond loopback, no background services, no GPU: a quiet, offline browser
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SCREENSHOT = ROOT / "docs" / "img" / "chat_page.png"
# records the length of the last answer's text at every change the page makes to it
WATCH = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const t = document.querySelectorAll('.turn.assistant .text');
    if (t.length) window.seen.push(t[t.length - 1].textContent.length);
  }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
}"""

# the page's markdown: fences, lists, headings, inline code and bold; HTML in model text stays text
MARKDOWN = ("# Title\n\nSee `x` and **this**:\n\n- one\n- two <b>\n\n1. first\n2. second\n\n"
            "```python\nprint('<img src=x onerror=alert(1)>')\n```")  # fmt: skip
RENDERED = (
    "<h3>Title</h3><p>See <code>x</code> and <strong>this</strong>:</p>"
    "<ul><li>one</li><li>two &lt;b&gt;</li></ul><ol><li>first</li><li>second</li></ol>"
    "<pre><code data-lang=\"python\">print('&lt;img src=x onerror=alert(1)&gt;')\n</code></pre>"
)
RENDER = "(md) => { const d = document.createElement('div'); renderMarkdown(d, md); return d.innerHTML; }"


@pytest.fixture
def browser_page(tmp_path):
    """A fresh headless Chromium page (new profile) and its console errors and request URLs."""
    if not CHROMIUM.exists():
        assert not os.environ.get("CI"), f"CI: {CHROMIUM} is missing (.ci/run installs it)"
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; .ci/run does it)")
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True, args=ARGS,
            viewport={"width": 900, "height": 760},
            bypass_csp=True,  # the page's CSP forbids eval, which the test's probes use
        )  # fmt: skip
        try:
            page = ctx.new_page()
            seen = {"errors": [], "urls": []}
            page.on("pageerror", lambda e: seen["errors"].append(str(e)))
            page.on("console", lambda m: m.type == "error" and seen["errors"].append(m.text))
            page.on("request", lambda r: seen["urls"].append(r.url))
            yield page, seen
        finally:
            ctx.close()


def _gguf_context(path) -> int:
    """The GGUF's own <arch>.context_length, read with the gguf library."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    return int(fields[f"{arch}.context_length"].parts[-1][0])


def _answer(page) -> str:
    return page.locator(".turn.assistant .text").last.inner_text()


def _wait_metrics(base: str, ok, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_chat_streams_stops_and_cancels(smollm2_gguf, browser_page, tmp_path):
    page, seen = browser_page
    with running_server(smollm2_gguf, api_key=None) as (base, _):
        # one request first: the server's first decode steps choose its thread count, and the
        # screenshot's tok/s should be the steady state's
        warm = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
        assert post(base + "/v1/chat/completions", json.dumps(warm).encode())[0] == 200
        page.goto(base + "/")
        page.wait_for_function("document.getElementById('model').textContent.length > 0")
        assert page.locator("#key-form").is_hidden()  # no --api-key: no key asked
        meta = json.loads(get(base + "/v1/models", None)[1])["data"][0]["meta"]
        assert 0 < meta["context"] <= _gguf_context(smollm2_gguf)
        msgs = [{"role": "user", "content": "Hi"}]
        code, err = post(base + "/v1/chat/completions",
                         json.dumps({"messages": msgs, "max_tokens": meta["context"]}).encode())  # fmt: skip
        assert code == 400 and f"context is {meta['context']} tokens" in err["error"]["message"]
        temperature = page.get_by_label("Temperature").get_attribute("placeholder")
        assert temperature == f"model default: {meta['defaults']['temperature']:g}"
        assert f"({meta['context']} tokens)" in page.get_by_label("Max tokens").get_attribute(
            "placeholder"
        )
        page.get_by_role("button", name="Settings").click()
        page.get_by_label("Temperature").fill("0")
        page.get_by_label("Max tokens").fill("48")
        page.evaluate(WATCH)
        page.get_by_label("Message").fill("What is the capital of France?")
        page.get_by_role("button", name="Send").click()
        page.locator(".turn.assistant .meta").last.wait_for(timeout=120_000)  # answer finished
        answer = _answer(page)
        assert "Paris" in answer, answer
        lengths = page.evaluate("window.seen")
        assert any(0 < n < len(answer) for n in lengths), lengths  # drawn before it was whole

        # a long answer, stopped while it streams: the server cancels it
        page.get_by_label("Max tokens").fill("")
        page.get_by_label("Message").fill("Write a very long story about a dragon and a knight.")
        page.get_by_role("button", name="Send").click()
        page.wait_for_function(
            "document.querySelectorAll('.turn.assistant').length === 2 &&"
            " document.querySelectorAll('.turn.assistant .text')[1].textContent.length > 40",
            timeout=120_000,
        )
        page.get_by_role("button", name="Stop").click()
        meta = page.locator(".turn.assistant .meta").nth(1)
        meta.wait_for(timeout=30_000)
        assert "stopped" in meta.inner_text()
        m = _wait_metrics(base, lambda m: m["poly_requests_cancelled_total"] >= 1)
        assert m["poly_requests_total"] == 3  # warm-up and the page's two; not the refused one
        assert m["poly_requests_cancelled_total"] == 1
        m = _wait_metrics(base, lambda m: m["poly_kv_sequences"] == 0)
        assert m["poly_kv_sequences"] == 0 and m["poly_batch_rows"] == 0
        assert page.get_by_role("button", name="Send").is_enabled()
        assert page.locator(".turn").count() == 4  # the conversation is kept

        shot = tmp_path / "chat_page.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("POLY_UPDATE_DOCS"):  # a test run leaves the tree as it found it
            shutil.copyfile(shot, SCREENSHOT)

        page.set_viewport_size({"width": 360, "height": 640})  # a phone-sized window
        assert page.evaluate("document.documentElement.scrollWidth") <= 360
    assert not seen["errors"], seen["errors"]
    assert all(u.startswith(base) or u.startswith("data:") for u in seen["urls"]), seen["urls"]


def test_api_key_asked_and_401_shown(smollm2_gguf, browser_page):
    page, seen = browser_page
    with running_server(smollm2_gguf) as (base, _):
        status, body = get(base + "/v1/models", key="wrong-key")
        assert status == 401
        message = json.loads(body)["error"]["message"]
        page.goto(base + "/")
        key = page.get_by_label("Key", exact=True)
        key.wait_for(state="visible")
        key.fill("wrong-key")
        page.get_by_role("button", name="Use key").click()
        page.wait_for_function(
            "document.getElementById('key-error').textContent.length > 0", timeout=10_000
        )
        assert page.locator("#key-error").inner_text() == message
        assert page.evaluate(RENDER, MARKDOWN) == RENDERED
        assert page.get_by_role("alert").filter(has_text=message).count() == 1

        key.fill(KEY)
        page.get_by_role("button", name="Use key").click()
        page.locator("#key-form").wait_for(state="hidden")
        assert page.evaluate("sessionStorage.getItem('lucy-api-key')") == KEY
        page.get_by_role("button", name="Settings").click()

        # a request the server refuses: its JSON error message is shown, the text kept to retry
        big = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1 << 20}
        code, err = post(base + "/v1/chat/completions", json.dumps(big).encode())
        assert code == 400
        page.get_by_label("Max tokens").fill(str(big["max_tokens"]))
        page.get_by_label("Message").fill("Hello")
        page.get_by_role("button", name="Send").click()
        page.locator("#error").wait_for(state="visible", timeout=30_000)
        assert page.locator("#error").inner_text() == err["error"]["message"]
        assert page.get_by_label("Message").input_value() == "Hello"
        assert page.locator(".turn").count() == 0

        page.get_by_label("Max tokens").fill("4")
        page.get_by_role("button", name="Send").click()
        page.locator(".turn.assistant .meta").last.wait_for(timeout=60_000)
        assert page.locator("#error").is_hidden()
        assert page.locator(".turn").count() == 2
    # the 401 and the 400 are logged by the browser as failed resource loads
    assert all("401" in e or "400" in e for e in seen["errors"]), seen["errors"]
