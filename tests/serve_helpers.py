"""Start `lucy serve` for real (a subprocess on a free loopback port) for the server tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def get(url: str, key: str | None = KEY, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, data: bytes, key: str | None = KEY, timeout: float = 60.0):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(base: str) -> dict[str, float]:
    _, text = get(base + "/metrics")
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            out[name] = float(value)
    return out


@contextlib.contextmanager
def running_server(model: str | Path, *args: str, timeout: float = 120.0,
                   api_key: str | None = KEY):  # fmt: skip
    """(base url, process) of `lucy serve MODEL --port P --api-key KEY *args` (no key with
    ``api_key=None``); stopped after."""
    port = free_port()
    cmd = [sys.executable, "-m", "lucy", "serve", str(model), "--port", str(port)]
    cmd += (["--api-key", api_key] if api_key else []) + list(args)
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lucy serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if get(base + "/health", None, 1.0)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("lucy serve did not become healthy")
            time.sleep(0.2)
        yield base, proc
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate (kill after 30 s) a server process and close its pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def read_response(
    s: socket.socket, timeout: float, keep_alive_ends: bool = False
) -> tuple[bytes, bool]:
    """(bytes received, whether the server closed the connection) within ``timeout``;
    ``keep_alive_ends``: also return once a whole response arrived on a kept-alive connection."""
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return data, False
        except (ConnectionResetError, BrokenPipeError):
            return data, True
        if not chunk:
            return data, True
        data += chunk
        if keep_alive_ends and _whole_keep_alive(data):
            return data, False
    return data, False


def _whole_keep_alive(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    length = [int(h.split(b":")[1]) for h in head.lower().split(b"\r\n")
              if h.startswith(b"content-length:")]  # fmt: skip
    return bool(length) and len(body) >= length[0] and b"connection: close" not in head.lower()


def lucy_generate(model: str | Path, prompt: str, n: int, chat: bool, greedy: bool = True) -> dict:
    """``greedy``: plain argmax (``--greedy``); False: temperature 0 with the model's other
    settings (its repetition controls), as a request with temperature 0 gets them."""
    sampling = ["--greedy"] if greedy else ["--temperature", "0"]
    cmd = [sys.executable, "-m", "lucy", "generate", str(model), "--prompt", prompt, *sampling]
    cmd += ["--max-tokens", str(n), "--json"] + (["--chat"] if chat else [])
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)
