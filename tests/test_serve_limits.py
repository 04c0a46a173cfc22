"""`lucy serve`'s limits against a real server on 127.0.0.1 (issue 56 items 6-8, issue 55):
request head size and read time over raw sockets, request JSON depth, bad fields answered 400,
start-up options that would leave the server unusable refused with one line and exit 2."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import (  # noqa: E402
    KEY,
    env,
    free_port,
    get,
    metrics,
    post,
    read_response,
    running_server,
)

MODEL = "tiny-limits"
TRAINED = 1024  # the checkpoint's max_position_embeddings
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("lim") / MODEL, "llama", seed=11,
        config_overrides={"max_position_embeddings": TRAINED},
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(ckpt):
    args = ("--header-timeout", "1", "--body-timeout", "1", "--log-level", "info")
    with running_server(ckpt, *args) as (base, proc):
        yield base, int(base.rsplit(":", 1)[1]), proc


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# --- item 6: the request head ----------------------------------------------------------------


def test_streamed_header_bombs_are_cut_off_and_cost_little_memory(server):
    base, port, _ = server
    rss0 = metrics(base)["poly_process_resident_bytes"]

    def bomb(_):
        with _connect(port) as s:
            try:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
                for _ in range(256):  # a 16 MiB header value, 64 KiB at a time
                    s.sendall(b"a" * 65536)
            except OSError:
                pass  # the server closed the connection mid-header: what we want
            return read_response(s, 10)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(bomb, range(8)))
    assert all(closed for _, closed in results)  # before: the server kept reading, never answered
    growth = metrics(base)["poly_process_resident_bytes"] - rss0
    assert growth < 40 << 20, growth / 1e6  # before: 167 MB for these 128 MiB of headers


def test_a_large_head_in_one_piece_gets_431(server):
    _, port, _ = server
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (40 << 10) + b"\r\n\r\n")
        raw, closed = read_response(s, 10)
    status, body = _status_and_json(raw)
    assert (status, body["error"]["code"], closed) == (431, "header_too_large", True)
    # an ordinary large head (8 KiB of cookies) still passes
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nCookie: " + b"c" * 8192 + b"\r\n\r\n")
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_half_sent_heads_and_silent_connections_are_closed(server):
    _, port, _ = server
    socks = []
    try:
        for i in range(60):
            s = _connect(port)
            if i % 3:  # a head that never ends; the others send nothing at all
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        start = time.monotonic()
        results = [read_response(s, 8) for s in socks]
        elapsed = time.monotonic() - start
    finally:
        for s in socks:
            s.close()
    assert all(closed for _, closed in results)  # before: open after minutes
    assert elapsed < 8
    answered = [_status_and_json(raw) for raw, _ in results if raw]
    assert answered and all(a[1]["error"]["code"] == "header_timeout" for a in answered)


def test_half_sent_body_gets_408_and_the_connection_closes(server):
    _, port, _ = server
    with _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH
                  + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")  # fmt: skip
        raw, closed = read_response(s, 8)
    status, body = _status_and_json(raw)
    assert (status, body["error"]["code"], closed) == (408, "body_timeout", True)


def test_keep_alive_requests_still_share_a_connection(server):
    _, port, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for _ in range(3):
            body = json.dumps({"prompt": "hi", "max_tokens": 2})
            conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
            time.sleep(0.3)
    finally:
        conn.close()


# --- item 7: bad input is 400, never 500 ------------------------------------------------------

DEEP = 100_000


def _deep_array(n: int) -> str:
    return "[" * n + "]" * n


def _deep_object(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


def _deep_schema(n: int) -> str:
    return '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + "}}" * n


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", '{"messages": ' + _deep_array(DEEP) + "}"),
        ("/v1/completions", '{"prompt": "hi", "user": ' + _deep_object(DEEP) + "}"),
        (
            "/v1/chat/completions",
            json.dumps({"messages": USER}).replace(
                "}]",
                '}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                '"schema": ' + _deep_schema(DEEP) + "}}",
                1,
            ),
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "assistant", "content": "", '
            '"tool_calls": ' + _deep_array(DEEP) + '}, {"role": "user", "content": "x"}]}',
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "tools": '
            '[{"type": "function", "function": {"name": "f", "parameters": '
            + _deep_schema(5000)
            + "}}]}",
        ),  # fmt: skip
    ],
    ids=["arrays", "objects", "schema", "tool_calls", "tool_parameters"],
)
def test_deep_json_is_400(server, path, body):
    base, _, _ = server
    status, out = post(base + path, body.encode())
    assert (status, out["error"]["code"]) == (400, "json_too_deep"), out  # before: 500


def test_brackets_inside_strings_are_not_nesting(server):
    base, _, _ = server
    content = "[{" * 50_000
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    status, out = post(base + "/v1/chat/completions", json.dumps(body).encode())
    assert status in (200, 400) and out.get("error", {}).get("code") != "json_too_deep", out


@pytest.mark.parametrize("name", [["f"], {"n": "f"}, 3])
def test_tool_choice_function_name_not_a_string_is_400(server, name):
    base, _, _ = server
    body = {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": name}}}  # fmt: skip
    status, out = post(base + "/v1/chat/completions", json.dumps(body).encode())
    assert (status, out["error"]["param"]) == (400, "tool_choice"), out  # before: 500


def test_logit_bias_is_refused_not_ignored(server):
    base, _, _ = server
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 100}}
    status, out = post(base + "/v1/completions", json.dumps(body).encode())
    assert (status, out["error"]["param"]) == (400, "logit_bias"), out
    body["logit_bias"] = {}  # an empty map changes nothing: accepted
    assert post(base + "/v1/completions", json.dumps(body).encode())[0] == 200


def test_completions_context_error_names_prompt(server):
    base, _, _ = server
    body = {"prompt": "hi", "max_tokens": TRAINED * 4}
    status, out = post(base + "/v1/completions", json.dumps(body).encode())
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["param"] == "prompt"  # before: "messages", a field it does not have


def test_request_log_lines(server):
    base, _, proc = server
    post(base + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 3}).encode())
    get(base + "/v1/models")
    text, deadline = b"", time.monotonic() + 10
    os.set_blocking(proc.stderr.fileno(), False)
    while time.monotonic() < deadline and b"GET /v1/models" not in text:
        select.select([proc.stderr], [], [], 0.2)
        text += proc.stderr.read() or b""
    lines = text.decode().splitlines()
    done = [ln for ln in lines if re.search(r"POST /v1/completions 200 \d+\+3 tokens \d+ ms", ln)]
    assert done and any(re.search(r"GET /v1/models 200 - tokens \d+ ms", ln) for ln in lines)


# --- item 8 and issue 55: start-up options ----------------------------------------------------


def _serve(ckpt, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lucy", "serve", str(ckpt), *args]
    try:
        return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # it started serving instead of refusing
        pytest.fail(f"lucy serve {' '.join(args)} did not exit: {err.stderr}")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ctx", "1000000000"], "--ctx must be in 2..16777216"),
        (["--ctx", "100000"], f"--ctx 100000 exceeds the model's context length {TRAINED}"),
        (["--ctx", "1024", "--kv-pages", "8"], "--ctx 1024 needs"),
        (["--max-queue", "0"], "--max-queue must be >= 1"),
        (["--max-queue", "-1"], "--max-queue must be >= 1"),
        (["--port", "70000"], "--port must be in 0..65535"),
    ],
    ids=["ctx-huge", "ctx-over-model", "ctx-over-pool", "queue-0", "queue-negative", "port-range"],
)
def test_unusable_start_up_options_exit_2(ckpt, args, message):
    out = _serve(ckpt, "--port", str(free_port()), *args, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert (out.returncode, len(lines)) == (2, 1), out.stderr
    assert lines[0].startswith(f"lucy: error: {message}")


def test_busy_port_is_one_line_and_exit_2(ckpt):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _serve(ckpt, "--port", str(port), timeout=60)
    assert out.returncode == 2  # before: 3, "model or file not found"
    assert out.stderr.strip().splitlines() == [f"lucy: error: port {port} on 127.0.0.1 is in use"]


def test_port_0_prints_the_port_bound(ckpt):
    cmd = [sys.executable, "-m", "lucy", "serve", str(ckpt), "--port", "0"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        line, deadline = b"", time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stderr], [], [], 0.5)[0]:
                line = proc.stderr.readline()
                if b" on http://" in line:
                    break
        m = re.search(rb"on http://127\.0\.0\.1:(\d+)$", line.strip())
        assert m and int(m[1]) != 0, line  # before: ":0"
        assert get(f"http://127.0.0.1:{int(m[1])}/health", None)[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()
