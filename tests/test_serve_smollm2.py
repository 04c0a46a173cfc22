"""`lucy serve` on the real SmolLM2-135M-Instruct GGUF: parity and concurrency (slow)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.serve_helpers import KEY, lucy_generate, metrics, running_server  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village",
    "def fibonacci(n):",
    "Hello, my name is",
    "The best way to learn a language",
    "1, 2, 3, 4,",
    "In the year 2050",
    "Water boils at",
]
N = 16


def test_greedy_parity_and_8_concurrent_streams(smollm2_gguf):
    # temperature 0 on both sides: the model's repetition controls apply to both alike
    ref = lucy_generate(smollm2_gguf, PROMPTS[0], N, chat=True, greedy=False)
    with running_server(smollm2_gguf, "--max-batch", "8") as (base, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        r = c.chat.completions.create(model=smollm2_gguf.stem, messages=msgs,
                                      max_tokens=N, temperature=0)  # fmt: skip
        assert r.choices[0].message.content == ref["text"]
        assert r.usage.completion_tokens == len(ref["tokens"])

        def one(prompt: str):
            s = c.completions.create(model=smollm2_gguf.stem, prompt=prompt, max_tokens=N,
                                     temperature=0, stream=True, logprobs=0)  # fmt: skip
            chunks = [ch.choices[0] for ch in s if ch.choices]
            return "".join(ch.text for ch in chunks), sum(len(ch.logprobs.tokens) for ch in chunks)

        alone = [one(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(one, PROMPTS))
        assert together == alone
        assert all(n == N for _, n in alone)
        m = metrics(base)
        assert m["poly_batch_occupancy"] > 1.5  # the concurrent ones really shared decode steps
        assert m["poly_kv_sequences"] == 0
