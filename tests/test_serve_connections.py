"""`lucy serve --max-connections`: a real server on 127.0.0.1 answers a connection past the cap
with 503 ``too_many_connections`` and closes it, serves again once connections close, and
refuses a cap the open-file limit cannot hold (one line, exit 2)."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import (  # noqa: E402
    env,
    free_port,
    get,
    read_response,
    running_server,
    stop_server,
)

CAP = 8
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("conn") / "tiny-conn", "llama", seed=12)


@pytest.fixture(scope="module")
def server(ckpt):
    # header timeout well past the test's length: the held connections must stay open
    args = ("--max-connections", str(CAP), "--header-timeout", "30")
    with running_server(ckpt, *args) as (base, _):
        yield base, int(base.rsplit(":", 1)[1])


def _hold(port: int, half_sent: bool) -> socket.socket:
    """A connection that stays open: after a health check (keep-alive) or mid-head."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if half_sent:
        s.sendall(HEALTH[:20])
        return s
    s.sendall(HEALTH)
    data, closed = read_response(s, 10, keep_alive_ends=True)
    assert data.startswith(b"HTTP/1.1 200") and not closed, data  # health works below the cap
    return s


@pytest.mark.parametrize("half_sent", [False, True], ids=["keep-alive", "half-sent-head"])
def test_connection_past_the_cap_gets_503_then_serving_resumes(server, half_sent):
    base, port = server
    held = [_hold(port, half_sent) for _ in range(CAP)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            t0 = time.monotonic()
            extra.sendall(HEALTH)
            data, closed = read_response(extra, 5, keep_alive_ends=True)
            took = time.monotonic() - t0
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), data  # before the cap existed: 200
        assert closed and took < 2, (closed, took)
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "server_error"
    finally:
        for s in held:
            s.close()
    deadline, status = time.monotonic() + 10, None
    while time.monotonic() < deadline and status != 200:  # the server sees the closes soon
        status = get(base + "/health", None, 5)[0]
        time.sleep(0.05)
    assert status == 200


def _serve(ckpt, *args: str, nofile: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    cmd = [sys.executable, "-m", "lucy", "serve", str(ckpt), "--port", str(free_port()), *args]
    try:
        return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=60,
                              preexec_fn=limit)  # fmt: skip
    except subprocess.TimeoutExpired as err:  # it started serving instead of refusing
        pytest.fail(f"lucy serve {' '.join(args)} did not exit: {err.stderr}")


@pytest.mark.parametrize(
    "args,nofile,message",
    [
        (["--max-connections", "0"], None, "--max-connections must be >= 1"),
        (["--max-connections", "1000"], 512, "--max-connections 1000 exceeds the 448 connections"),
    ],
    ids=["zero", "over-ulimit"],
)
def test_unusable_max_connections_exit_2(ckpt, args, nofile, message):
    out = _serve(ckpt, *args, nofile=nofile)
    lines = out.stderr.strip().splitlines()
    assert (out.returncode, len(lines)) == (2, 1), out.stderr
    assert lines[0].startswith(f"lucy: error: {message}")


def test_default_cap_stays_within_a_low_open_file_limit(ckpt):
    """Under ``ulimit -n 96`` the default cap is 32 (96 less 64 kept for the process): a 33rd
    connection gets 503 instead of the accept failing with EMFILE."""
    port = free_port()
    cmd = [sys.executable, "-m", "lucy", "serve", str(ckpt), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96)))  # fmt: skip
    held = []
    try:
        deadline, status = time.monotonic() + 120, None
        while status != 200 and proc.poll() is None and time.monotonic() < deadline:
            try:
                status = get(f"http://127.0.0.1:{port}/health", None, 1)[0]
            except OSError:
                time.sleep(0.2)
        assert status == 200, proc.stderr.read().decode()[-2000:] if proc.poll() else status
        held = [_hold(port, half_sent=True) for _ in range(32)]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            extra.sendall(HEALTH)
            data, closed = read_response(extra, 5, keep_alive_ends=True)
        assert data.startswith(b"HTTP/1.1 503") and closed, data
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
        stop_server(proc)
