"""`lucy serve --memory SIZE` (issue 60, acceptance 5 on the server): a budget too small for the
dense part is one line naming what it needs; one that fits sizes the context and the KV pool
by `entity.fit`'s plan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from entity.fit import parse_size, plan
from tests.serve_helpers import env, free_port, metrics, running_server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.hf_fixtures import make_tiny_checkpoint

    over = {"max_position_embeddings": 1024}
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("serve_mem") / "m", "llama",
                                    config_overrides=over))  # fmt: skip


def test_serve_memory_too_small_is_one_line(tiny):
    cmd = [sys.executable, "-m", "lucy", "serve", tiny, "--memory", "10M", "--port",
           str(free_port())]  # fmt: skip
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lucy: error: 10.00 MiB does not fit: ")
    need = plan(tiny, 1 << 40, 256)[0].total  # the least it asks for: the context shrunk to 256
    assert lines[0].endswith(f"at least {need / (1 << 20):.2f} MiB")


def test_serve_memory_sizes_the_context_and_the_kv_pool(tiny):
    fp_plan, fp = plan(tiny, 1 << 40, None)
    # room for the dense part and 512 positions of KV cache, not the model's 1024
    memory = fp_plan.total - fp.run_bytes(1024) + fp.run_bytes(512)
    want = plan(tiny, memory)[0]
    assert want.ctx == 512 and want.total <= memory
    with running_server(tiny, "--memory", str(memory)) as (base, _):
        m = metrics(base)
        assert m["poly_kv_pages_total"] == 512 // 16
    assert parse_size(str(memory)) == memory
