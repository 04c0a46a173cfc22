"""Sliding-window attention against transformers (eager, float32) on tiny random checkpoints.

Mistral with a window of 16 runs a 64-token prompt (4x its window) and 32 greedy tokens: logits
at every position, one token a call on the KV cache, greedy with and without the cache; its
cache holds the window, not the context. qwen2 slides only in the layers past max_window_layers.
The fused C step runs these windows (one token a call below is the C step at every position);
the served path (contiguous caches, batched rows) gives transformers' tokens too.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import entity
from poly.errors import ConfigError, GenerationError, LayerConfigError
from poly.runtime import fused
from poly.runtime.batch import forward_batch
from tests.hf_fixtures import make_tiny_checkpoint, set_config_keys

WINDOW = 16
PROMPT = [(7 * i + 3) % 290 + 5 for i in range(4 * WINDOW)]  # 64 = 4 x the window
N_NEW = 32
CONFIGS = {
    "mistral": {"sliding_window": WINDOW, "max_position_embeddings": 256},
    # layers 1 and 2 slide, layer 0 attends to everything (transformers' layer_types rule)
    "qwen2": {"sliding_window": WINDOW, "max_position_embeddings": 256,
              "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 3},
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    arch = request.param
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(arch), arch, seed=2, config_overrides=CONFIGS[arch]
    )


@functools.lru_cache(maxsize=4)
def _hf_run(path: str) -> tuple[np.ndarray, list[int]]:
    """transformers' logits at every position of PROMPT and its N_NEW greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    x = torch.tensor([PROMPT], dtype=torch.long)
    with torch.no_grad():
        logits = model(x, use_cache=False).logits[0].numpy()
        seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N_NEW, eos_token_id=[], pad_token_id=0)  # fmt: skip
    return logits, seq[0, len(PROMPT) :].tolist()


def _greedy_cached(tf) -> list[int]:
    tf.reset()
    logits, got = tf.forward(PROMPT), []
    for _ in range(N_NEW):
        got.append(int(np.argmax(logits)))
        logits = tf.forward([got[-1]])
    return got


def test_windows_match_transformers(checkpoint):
    want_logits, want_tokens = _hf_run(str(checkpoint))
    tf = entity.load(checkpoint)
    windows = [tf.attn(i).sliding_window for i in range(tf.config.num_layers)]
    assert windows == ([WINDOW] * 2 if tf.config.architecture == "mistral" else [0, WINDOW, WINDOW])
    assert fused.plan(tf) is not None  # the fused C step attends over the window
    np.testing.assert_allclose(tf.forward_all(PROMPT), want_logits, atol=1e-4, rtol=0)
    tf.reset()
    steps = np.stack([tf.forward([t]) for t in PROMPT])  # one token a call on the cache
    np.testing.assert_allclose(steps, want_logits, atol=1e-4, rtol=0)
    assert _greedy_cached(tf) == want_tokens
    # the cache of a sliding layer holds its window (and a margin), not the 96 positions
    sliding = tf.attn(tf.config.num_layers - 1).state
    assert sliding.length == len(PROMPT) + N_NEW and sliding.k.shape[0] <= 3 * WINDOW
    nocache = list(PROMPT)  # without the cache: the whole sequence again for every token
    for _ in range(N_NEW):
        tf.reset()
        nocache.append(int(np.argmax(tf.forward_all(nocache)[-1])))
    assert nocache[len(PROMPT) :] == want_tokens


def test_batched_rows_honour_the_window(checkpoint):
    # forward_batch: prompts of different lengths as segments of one pass, then decode rows
    want_logits, want_tokens = _hf_run(str(checkpoint))
    tf = entity.load(checkpoint)
    states = [tf.new_state(), tf.new_state()]
    logits = forward_batch(tf, [PROMPT, PROMPT[:40]], states)
    np.testing.assert_allclose(logits[0], want_logits[-1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1], want_logits[39], atol=1e-4, rtol=0)
    got = []
    for _ in range(8):
        tokens = [int(t) for t in np.argmax(logits, axis=-1)]
        got.append(tokens[0])
        logits = forward_batch(tf, [[t] for t in tokens], states)
    assert got == want_tokens[:8]


def test_rollback_past_the_window_reruns_the_prefix(checkpoint):
    tf = entity.load(checkpoint)
    tf.forward(PROMPT)
    last = tf.config.num_layers - 1
    with pytest.raises(GenerationError, match="sliding-window"):
        tf.attn(last).state.truncate(WINDOW)
    # a generation continuing a history the cache can no longer roll back to runs it again
    _, want_tokens = _hf_run(str(checkpoint))
    tf.reset()
    tf.forward(PROMPT + [1, 2, 3])
    from poly.text.generation import stream_tokens
    from poly.text.sampling import GenOptions

    options = GenOptions(temperature=0, max_tokens=4)
    events = list(stream_tokens(tf, PROMPT[-8:], options, start_fresh=False,
                                history=PROMPT[:-8]))  # fmt: skip
    assert [e.token_id for e in events[:-1]] == want_tokens[:4]


def test_window_of_zero_is_refused_by_name(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "mistral", config_overrides=CONFIGS["mistral"])
    set_config_keys(path, sliding_window=0)
    with pytest.raises(ConfigError, match="sliding_window") as e:
        entity.load(path)
    assert "\n" not in str(e.value)
    from poly.recipe import AttentionConfig

    with pytest.raises(LayerConfigError, match="sliding_window"):
        AttentionConfig(sliding_window=0)


def test_paged_pool_refuses_a_window_and_serving_defaults_to_contiguous(checkpoint):
    from poly.serving.kv import ContiguousKV, make_kv
    from poly.serving.paged import PagedKV

    tf = entity.load(checkpoint)
    assert isinstance(make_kv(tf), ContiguousKV)
    with pytest.raises(LayerConfigError, match="sliding-window"):
        PagedKV(tf, 64)


def test_lucy_serve_runs_a_windowed_model(checkpoint):
    pytest.importorskip("fastapi")
    from tests.serve_helpers import post, running_server

    _, want_tokens = _hf_run(str(checkpoint))
    tf = entity.load(checkpoint)
    want_text = tf.tokenizer.decode(want_tokens[:12])
    body = {"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with running_server(checkpoint, "--max-batch", "2") as (base, _):
        status, got = post(base + "/v1/completions", json.dumps(body).encode())
    assert status == 200, got
    assert got["choices"][0]["text"] == want_text
