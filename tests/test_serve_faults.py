"""`lucy serve` under faults and load (loopback, bounded loops): random disconnects, a full
queue, oversized prompts; the server keeps serving and gives every KV page back."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import KEY, metrics, post, running_server  # noqa: E402

MODEL = "tiny-faults"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("f") / MODEL, "llama", seed=9,
        config_overrides={"max_position_embeddings": 1024},
    )  # fmt: skip


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _idle(base):
    for _ in range(200):
        m = metrics(base)
        if (
            m["poly_batch_rows"] == 0
            and m["poly_queue_length"] == 0
            and m["poly_kv_sequences"] == 0
        ):
            return m
        threading.Event().wait(0.05)
    raise AssertionError(f"server not idle: {m}")


@pytest.mark.slow
def test_200_requests_16_clients_random_disconnects(ckpt):
    rng = random.Random(0)
    plan = [(rng.random() < 0.4, rng.randint(1, 6), rng.choice([0.0, 0.9])) for _ in range(200)]
    with running_server(ckpt, "--max-batch", "8") as (base, _):
        c = _client(base)
        c.completions.create(model=MODEL, prompt="warm up", max_tokens=2)
        rss0 = metrics(base)["poly_process_resident_bytes"]

        def one(i: int):
            drop, after, temp = plan[i]
            prompt = f"The quick brown fox {i} " * (1 + i % 5)
            s = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=temp,
                                     stream=True, seed=i)  # fmt: skip
            n = 0
            for _chunk in s:
                n += 1
                if drop and n >= after:
                    s.close()  # the client goes away mid-stream
                    return "dropped"
            return n

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(200)))
        m = _idle(base)
        dropped = sum(r == "dropped" for r in results)
        assert 50 <= dropped <= sum(p[0] for p in plan)  # a few end (EOS) before their drop point
        assert m["poly_kv_pages_used"] == 0 and m["poly_kv_tokens"] == 0
        assert m["poly_requests_finished_total"] == m["poly_requests_total"] == 201
        assert m["poly_requests_cancelled_total"] >= 1
        assert m["poly_process_resident_bytes"] - rss0 < 20 << 20
        ok = c.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
        assert ok.usage.completion_tokens == 3


def test_full_queue_is_429_and_long_prompt_400(ckpt):
    with running_server(ckpt, "--max-batch", "1", "--max-queue", "1") as (base, _):
        c = _client(base)
        running = c.completions.create(model=MODEL, prompt="a", max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(running))  # it runs: the batch (1 row) is full
        waiting = c.completions.create(model=MODEL, prompt="b", max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
        with pytest.raises(openai.RateLimitError) as info:
            for _ in range(50):  # the second one may still be in flight: bounded retries
                c.completions.create(model=MODEL, prompt="c", max_tokens=2)
        assert info.value.body["code"] == "queue_full"
        running.close()
        waiting.close()
        huge = "fox " * 100_000  # far past the context (and the tokenizer must cope)
        status, data = post(base + "/v1/completions", json.dumps({"prompt": huge}).encode())
        assert status == 400 and data["error"]["code"] == "context_length_exceeded"
        m = _idle(base)
        assert m["poly_kv_pages_used"] == 0
