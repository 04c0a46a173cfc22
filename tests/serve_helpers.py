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
def running_server(model: str | Path, *args: str, timeout: float = 120.0):
    """(base url, process) of `lucy serve MODEL --port P --api-key KEY *args`; stopped after."""
    port = free_port()
    cmd = [sys.executable, "-m", "lucy", "serve", str(model), "--port", str(port)]
    cmd += ["--api-key", KEY, *args]
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
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def lucy_generate(model: str | Path, prompt: str, n: int, chat: bool, greedy: bool = True) -> dict:
    """``greedy``: plain argmax (``--greedy``); False: temperature 0 with the model's other
    settings (its repetition controls), as a request with temperature 0 gets them."""
    sampling = ["--greedy"] if greedy else ["--temperature", "0"]
    cmd = [sys.executable, "-m", "lucy", "generate", str(model), "--prompt", prompt, *sampling]
    cmd += ["--max-tokens", str(n), "--json"] + (["--chat"] if chat else [])
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)
