"""poly.serving.Scheduler: continuous batching equals single-sequence generation.

The model is a tiny random HF checkpoint (tests/hf_fixtures.py) loaded through entity.load, so
it has a real tokenizer; logprobs are checked against transformers' own logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from poly.errors import ContextOverflowError, QueueFullError, SamplingParamsError
from poly.serving import RequestDone, SamplingParams, Scheduler, TokenOut
from poly.serving.kv import ContiguousKV
from poly.serving.paged import PagedKV
from tests.hf_fixtures import hf_logits, make_tiny_checkpoint

PROMPTS = ["The quick brown fox", "Hello world!", "poly is a local", "Once upon a time there was"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def model(ckpt):
    import entity

    return entity.load(str(ckpt))


def _ids(model, text):
    return list(model.tokenizer.encode(text))


def _run(s: Scheduler):
    while s.step():
        pass


def _greedy_ref(model, ids, n):
    done = model.generate(ids, temperature=0.0, top_k=0, max_tokens=n, repetition_penalty=1.0)
    return list(done.tokens), done.text


@pytest.mark.parametrize("max_batch", [1, 3, 16])
def test_greedy_batched_equals_single_sequence(model, max_batch):
    ids = [_ids(model, p) for p in PROMPTS]
    refs = [_greedy_ref(model, p, 12) for p in ids]
    s = Scheduler(model, max_batch=max_batch)
    hs = [
        s.submit(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=False)) for p in ids
    ]
    _run(s)
    for h, (ref_ids, ref_text) in zip(hs, refs):
        c = h.result(0)
        assert c.choices[0].token_ids == ref_ids
        assert c.choices[0].text == ref_text
        assert c.usage.prompt_tokens == len(h.prompt)
        assert c.usage.completion_tokens == len(ref_ids)
    assert s.idle() and s.kv.stats()["kv_sequences"] == 0


def test_contiguous_kv_greedy_equals_single_sequence(model):
    ids = [_ids(model, p) for p in PROMPTS]
    refs = [_greedy_ref(model, p, 12)[0] for p in ids]
    s = Scheduler(model, kv=ContiguousKV(model))
    hs = [s.submit(p, SamplingParams(max_tokens=12, temperature=0.0, n=2)) for p in ids]
    _run(s)
    for h, ref in zip(hs, refs):
        assert [c.token_ids for c in h.result(0).choices] == [ref, ref]
    assert s.kv.stats() == {"kv_sequences": 0, "kv_tokens": 0}


def test_paged_logits_equal_contiguous_bitwise(model):
    """One numerics: the paged decode (page tables in the C step, pages of 3 positions so every
    row crosses pages) gives the contiguous cache's logits exactly."""
    ids = [_ids(model, p) for p in PROMPTS]
    p = SamplingParams(max_tokens=20, temperature=0.0, logprobs=5, n=2)
    out = []
    for kv in (ContiguousKV(model), PagedKV(model, 200, page_size=3)):
        s = Scheduler(model, kv=kv)
        hs = [s.submit(x, p) for x in ids]
        _run(s)
        out.append([[(lp.token_id, lp.logprob, lp.top) for c in h.result(0).choices
                     for lp in c.logprobs] for h in hs])  # fmt: skip
    assert out[0] == out[1]
    assert kv.pool.used == 0 and kv.pool.reserved == 0  # forks' promises returned too


def test_prefix_reuse_shares_pages_and_keeps_output(model):
    system = _ids(model, " ".join(PROMPTS * 3))
    a, b = system + _ids(model, " Hello"), system + _ids(model, " world!")
    refs = [_greedy_ref(model, x, 8)[0] for x in (a, b)]
    kv = PagedKV(model, 64, page_size=8)
    s = Scheduler(model, kv=kv)
    first = s.submit(a, SamplingParams(max_tokens=8, temperature=0.0))
    _run(s)
    second = s.submit(b, SamplingParams(max_tokens=8, temperature=0.0))
    _run(s)
    r1, r2 = first.result(0), second.result(0)
    assert r1.usage.cached_tokens == 0
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    # the full pages of the shared prefix, then its part of the next page copied from the
    # first request's kept page (sub-page reuse)
    assert shared % 8 and r2.usage.cached_tokens == shared > (len(system) // 8) * 8
    assert [r1.choices[0].token_ids, r2.choices[0].token_ids] == refs
    assert s.metrics.prefix_hit_tokens == r2.usage.cached_tokens
    st = kv.stats()
    assert st["kv_pages_used"] == 0 and st["kv_pages_cached"] > 0


def test_repeated_short_prompt_reuses_its_kept_last_page(model):
    """A prompt shorter than a page, sent again: all but its last token come from the first
    request's kept partial page (llama.cpp's server slots do the same), the output unchanged."""
    ids = _ids(model, PROMPTS[3])[:6]
    ref = _greedy_ref(model, ids, 10)[0]
    kv = PagedKV(model, 32, page_size=16)
    s = Scheduler(model, kv=kv)
    got = []
    for _ in range(3):
        h = s.submit(ids, SamplingParams(max_tokens=10, temperature=0.0))
        _run(s)
        got.append(h.result(0))
    assert [r.usage.cached_tokens for r in got] == [0, 5, 5]
    assert all(r.choices[0].token_ids == ref for r in got)
    assert kv.pool.used == 0 and kv.pool.reserved == 0


def test_pool_pressure_evicts_lru_and_queues(model):
    kv = PagedKV(model, 12, page_size=4)  # 48 positions: two requests of 20 at a time
    s = Scheduler(model, kv=kv)
    ids = [_ids(model, p)[:6] for p in PROMPTS]
    refs = [_greedy_ref(model, x, 14)[0] for x in ids]
    hs = [s.submit(x, SamplingParams(max_tokens=14, temperature=0.0)) for x in ids]
    peak = 0
    while s.step():
        peak = max(peak, kv.pool.used)
    assert [h.result(0).choices[0].token_ids for h in hs] == refs
    assert peak <= 12 and kv.pool.used == 0 and kv.pool.reserved == 0
    kept = [p for kids in kv.pool.children.values() for p in kids]  # evictions left no stale entry
    assert kept and sorted(kept) == sorted(kv.pool.hash_of)
    with pytest.raises(ContextOverflowError):
        s.submit(ids[0], SamplingParams(max_tokens=60))


def test_memory_follows_live_tokens(model):
    kv = PagedKV(model, 16 * 20, page_size=16)
    s = Scheduler(model, kv=kv, max_batch=16)
    ids = [(_ids(model, " ".join(PROMPTS * 4)) + [5] * 100)[:100] for _ in range(16)]
    for i, x in enumerate(ids):
        x[-1] = 10 + i  # 16 different prompts of 100 tokens
        s.submit(x, SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(17):  # one prefill per step: all 16 run after 16 steps
        s.step()
    st = kv.stats()
    assert s.rows == 16 and st["kv_sequences"] == 16
    assert 16 * 100 <= st["kv_tokens"] <= 16 * 117
    assert st["kv_pages_used"] * 16 <= 1.2 * st["kv_tokens"]
    _run(s)
    assert kv.pool.used == 0


def test_requests_join_a_running_batch(model):
    ids = [_ids(model, p) for p in PROMPTS]
    refs = [_greedy_ref(model, p, 10)[0] for p in ids]
    s = Scheduler(model, max_batch=4)
    first = s.submit(ids[0], SamplingParams(max_tokens=10, temperature=0.0))
    for _ in range(4):
        s.step()
    passes, many = [], s.kv.prefill_many
    s.kv.prefill_many = lambda seqs, chunks: (
        passes.append([len(c) for c in chunks]) or many(seqs, chunks)
    )
    later = [s.submit(p, SamplingParams(max_tokens=10, temperature=0.0)) for p in ids[1:]]
    _run(s)
    assert [h.result(0).choices[0].token_ids for h in [first, *later]] == refs
    # the joiners' prompts rode along with the running decode rows (16 rows a call at most):
    # [1, 6, 8] then [1, 1, 1, 12]
    assert sorted(n for p in passes for n in p if n > 1) == sorted(len(p) for p in ids[1:])
    assert len(passes) == 2 and all(p[0] == 1 and sum(p) <= 16 for p in passes)


def test_rows_alike_only_where_one_prompt_takes_no_other_path(model, monkeypatch):
    from poly.runtime import ckernels, fused

    assert fused.rows_alike(model)  # float32 weights: the row kernels for any rows
    p = fused.plan(model)
    monkeypatch.setattr(p, "kinds", p.kinds | {ckernels.Q4_K})
    assert not fused.rows_alike(model)  # "auto": a K-quant prompt alone takes int8 panels
    monkeypatch.setattr(ckernels, "_opts", {"q8": ckernels.Q8_OFF})
    assert fused.rows_alike(model)


def test_long_prompt_prefill_is_chunked(model):
    s = Scheduler(model, max_batch=4, prefill_chunk=4)
    running = s.submit(_ids(model, PROMPTS[1])[:3], SamplingParams(max_tokens=30, temperature=0))
    s.step()  # prefill (one chunk) + first token
    long = _ids(model, " ".join(PROMPTS * 2))
    s.submit(long, SamplingParams(max_tokens=2, temperature=0))
    got = []
    for _ in range((len(long) + 3) // 4):
        s.step()  # the running request gets a token in every step of the long prefill
        got.append(sum(isinstance(e, TokenOut) for e in running.poll()))
    assert all(g == 1 for g in got[1:])
    _run(s)


def test_seed_reproducible_and_choices_use_seed_plus_index(model):
    ids = _ids(model, PROMPTS[0])
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=11, n=3)
    s = Scheduler(model)
    a, b = s.submit(ids, p), s.submit(ids, p)
    c1 = s.submit(ids, SamplingParams(max_tokens=16, temperature=1.0, seed=12))
    _run(s)
    ra, rb = a.result(0), b.result(0)
    assert [c.token_ids for c in ra.choices] == [c.token_ids for c in rb.choices]
    assert ra.choices[1].token_ids == c1.result(0).choices[0].token_ids
    assert len({tuple(c.token_ids) for c in ra.choices}) > 1
    assert ra.usage.completion_tokens == sum(len(c.token_ids) for c in ra.choices)


def test_logprobs_match_transformers(model, ckpt):
    ids = _ids(model, PROMPTS[2])
    s = Scheduler(model)
    h = s.submit(ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    _run(s)
    ch = h.result(0).choices[0]
    ref = hf_logits(ckpt, ids + ch.token_ids[:-1])[len(ids) - 1 :]  # [4, V]
    for lp, row in zip(ch.logprobs, ref):
        row = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
        assert lp.token_id == int(np.argmax(row))
        np.testing.assert_allclose(lp.logprob, row[lp.token_id], atol=1e-4)
        top = np.argsort(-row, kind="stable")[:3]
        assert [t for t, _ in lp.top] == top.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], row[top], atol=1e-4)


def test_stop_string_cuts_text(model):
    ids = _ids(model, PROMPTS[3])
    _, text = _greedy_ref(model, ids, 20)
    stop = text[3:5]
    assert stop and stop in text
    s = Scheduler(model)
    h = s.submit(ids, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]))
    _run(s)
    ch = h.result(0).choices[0]
    assert ch.text == text[: text.index(stop)]
    assert ch.finish_reason == "stop"


def test_frequency_penalty_matches_the_openai_formula(model):
    ids = _ids(model, PROMPTS[0])
    fp, pp = 1.5, 0.5
    model.reset()
    logits, out, counts = model.forward(ids), [], {}
    for _ in range(8):  # reference: logit[t] -= pp * (count > 0) + fp * count
        x = logits.astype(np.float64).copy()
        for t, c in counts.items():
            x[t] -= pp + fp * c
        tok = int(np.argmax(x))
        out.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        logits = model.forward([tok])
    s = Scheduler(model)
    p = SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=fp, presence_penalty=pp)
    h = s.submit(ids, p)
    _run(s)
    assert h.result(0).choices[0].token_ids == out


def test_cancel_frees_the_sequence(model):
    s = Scheduler(model)
    h = s.submit(_ids(model, PROMPTS[0]), SamplingParams(max_tokens=50, temperature=0))
    s.step()
    s.step()
    h.cancel()
    s.step()
    events = list(h)
    assert isinstance(events[-1], RequestDone) and events[-1].finish_reasons == ("cancelled",)
    assert sum(isinstance(e, TokenOut) for e in events) == 2
    st = s.kv.stats()
    assert s.idle() and st["kv_sequences"] == 0 and st["kv_pages_used"] == 0


def test_rejections(model):
    s = Scheduler(model, max_queue=1)
    ids = _ids(model, PROMPTS[0])
    with pytest.raises(ContextOverflowError):
        s.submit(ids, SamplingParams(max_tokens=model.config.max_seq_len))
    s.submit(ids, SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        s.submit(ids, SamplingParams(max_tokens=2))
    with pytest.raises(SamplingParamsError):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingParamsError):
        SamplingParams(n=0)


def test_thread_loop_and_shutdown(model):
    ids = _ids(model, PROMPTS[0])
    ref, _ = _greedy_ref(model, ids, 6)
    s = Scheduler(model).start()
    h = s.submit(ids, SamplingParams(max_tokens=6, temperature=0.0))
    assert h.result(60).choices[0].token_ids == ref
    s.shutdown(drain=5)


@pytest.mark.parametrize("kv_kind", ["paged", "contiguous"])
def test_waiting_prompts_prefill_in_one_pass_with_transformers_logits(model, ckpt, kv_kind):
    """Four prompts submitted together run as one prefill pass (rows of all four in each
    matmul); every first token's log-probabilities match transformers' on that prompt alone."""
    ids = [_ids(model, p) for p in PROMPTS]
    kv = PagedKV(model, 200, page_size=3) if kv_kind == "paged" else ContiguousKV(model)
    s = Scheduler(model, kv=kv)
    passes = []
    many = kv.prefill_many
    kv.prefill_many = lambda seqs, chunks: passes.append(len(chunks)) or many(seqs, chunks)
    hs = [s.submit(x, SamplingParams(max_tokens=2, temperature=0.0, logprobs=3)) for x in ids]
    _run(s)
    assert passes == [len(PROMPTS)]
    for h, x in zip(hs, ids):
        ch = h.result(0).choices[0]
        ref = hf_logits(ckpt, x + ch.token_ids[:1])[len(x) - 1 :]  # [2, V]
        for lp, row in zip(ch.logprobs, ref):
            row = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
            assert lp.token_id == int(np.argmax(row))
            np.testing.assert_allclose([v for _, v in lp.top], np.sort(row)[::-1][:3], atol=1e-4)
    off = Scheduler(model, batch_prefill=False)
    off.kv.prefill_many = lambda *a: pytest.fail("batch_prefill=False ran a multi-prompt pass")
    hs = [off.submit(x, SamplingParams(max_tokens=1, temperature=0.0)) for x in ids]
    _run(off)
    assert all(h.result(0).choices[0].token_ids for h in hs)


def test_scratch_pages_of_a_batched_prefill_are_given_back(model, monkeypatch):
    """After a multi-prompt pass the KV lives in the pool's pages only: every scratch cache
    array is released (`release_pages`), and a released reservation reads as zeros again."""
    import poly.nn.mha as mha

    big = mha.lazy_zeros((4096, 2, 64), np.float32)  # 2 MB: a mapping of its own
    big[:] = 1.0
    mha.release_pages(big)
    assert not big.any()
    released = []
    monkeypatch.setattr(mha, "release_pages", lambda arr: released.append(id(arr)))
    kv = PagedKV(model, 200, page_size=3)
    monkeypatch.setattr(kv, "_prefill_rows", lambda seqs, chunks: None)  # the scratch path
    s = Scheduler(model, kv=kv)
    hs = [s.submit(_ids(model, p), SamplingParams(max_tokens=1, temperature=0.0)) for p in PROMPTS]
    _run(s)
    assert all(h.result(0).choices[0].token_ids for h in hs)
    arrays = {id(a) for st in kv._scratches for c in st for a in (c.k, c.v)}
    assert len(kv._scratches) == len(PROMPTS) and arrays <= set(released)
