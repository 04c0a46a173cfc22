"""GenOptions validation and Sampler processors, checked against HF transformers' processors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from poly.errors import NumericalError, SamplingParamsError
from poly.text.sampling import GenOptions, Sampler, no_repeat_ngram_bans

V = 64


def rand_logits(seed: int, v: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(v) * scale).astype(np.float32)


def hf(processors, logits: np.ndarray, input_ids=()) -> np.ndarray:
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    scores = torch.from_numpy(logits.copy())[None, :]
    return LogitsProcessorList(processors)(ids, scores)[0].numpy()


def assert_same_filter(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    keep = np.isfinite(ref)
    np.testing.assert_allclose(ours[keep], ref[keep], rtol=1e-6, atol=1e-6)


# --- validation ----------------------------------------------------------------------------------

BAD = [
    ("max_tokens", 0),
    ("max_tokens", 2.5),
    ("min_tokens", -1),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_k", -1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("min_p", 1.0),
    ("min_p", -0.1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")),
    ("repetition_window", -2),
    ("no_repeat_ngram", -1),
    ("banned_tokens", [-3]),
    ("banned_tokens", "abc"),
    ("eos_tokens", [1.5]),
    ("seed", -1),
    ("seed", 1.5),
    ("deterministic", "yes"),
    ("stop", [""]),
    ("truncate", "middle"),
]


@pytest.mark.parametrize("name,value", BAD)
def test_invalid_options_name_the_field(name, value):
    with pytest.raises(SamplingParamsError, match=name):
        GenOptions(**{name: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        GenOptions(max_tokens=4, min_tokens=5)


def test_replace_validates_and_rejects_unknown_names():
    o = GenOptions(top_k=5)
    assert o.replace(top_k=7).top_k == 7 and o.top_k == 5
    with pytest.raises(SamplingParamsError, match="top_p"):
        o.replace(top_p=2.0)
    with pytest.raises(SamplingParamsError, match="bogus"):
        o.replace(bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.top_k = 3


def test_sampler_rejects_out_of_vocab_ids():
    with pytest.raises(SamplingParamsError, match="banned_tokens"):
        Sampler(GenOptions(banned_tokens=(V,)), V)
    with pytest.raises(SamplingParamsError, match="eos_tokens"):
        Sampler(GenOptions(), V, eos_tokens=(V + 5,))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_raise(bad):
    x = rand_logits(0)
    x[7] = bad
    for opts in (GenOptions(seed=0), GenOptions(temperature=0.0)):
        with pytest.raises(NumericalError):
            Sampler(opts, V).sample(x)


def test_huge_finite_logits_are_not_refused():
    x = np.full(V, 3e38, dtype=np.float32)  # finite, but their sum overflows
    x[3] = 3.3e38
    assert Sampler(GenOptions(temperature=0.0), V).sample(x) == 3


def test_everything_masked_raises():
    opts = GenOptions(banned_tokens=tuple(range(V)), seed=0)
    with pytest.raises(NumericalError):
        Sampler(opts, V).sample(rand_logits(1))


# --- determinism and greedy ---------------------------------------------------------------------


def draws(opts: GenOptions, logits: np.ndarray, n: int) -> list[int]:
    s = Sampler(opts, logits.shape[0])
    return [s.sample(logits) for _ in range(n)]


def test_same_seed_same_tokens_different_seed_differs():
    flat = np.zeros(V, dtype=np.float32)
    opts = GenOptions(temperature=1.0, top_k=0, seed=123)
    a, b = draws(opts, flat, 50), draws(opts, flat, 50)
    c = draws(opts.replace(seed=124), flat, 50)
    assert a == b
    assert a != c
    assert len(set(a)) > 20  # a flat distribution really spreads


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_and_tiny_temperature_equal_greedy(seed):
    x = rand_logits(seed)
    want = int(np.argmax(x))
    assert draws(GenOptions(temperature=0.0), x, 3) == [want] * 3
    assert draws(GenOptions(deterministic=True, temperature=1.0), x, 3) == [want] * 3
    assert draws(GenOptions(top_k=1, temperature=1.5, seed=seed), x, 20) == [want] * 20
    assert draws(GenOptions(temperature=1e-4, top_k=0, seed=seed), x, 20) == [want] * 20


def test_greedy_picks_first_maximum():
    x = np.zeros(V, dtype=np.float32)
    x[[5, 9]] = 2.0
    assert draws(GenOptions(temperature=0.0), x, 1) == [5]


def test_top_p_one_is_a_noop():
    x = rand_logits(3)
    base = GenOptions(temperature=0.8, top_k=0, seed=9)
    s = Sampler(base.replace(top_p=1.0), V)
    ref = torch.softmax(torch.from_numpy(x) / 0.8, dim=-1).double().numpy()
    np.testing.assert_allclose(s.probabilities(x), ref, rtol=1e-5, atol=1e-9)
    assert draws(base.replace(top_p=1.0), x, 100) == draws(base, x, 100)


# --- parity with HF transformers' processors ----------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 5, 17, V - 1, V])
def test_top_k_matches_hf(seed, k):
    x = rand_logits(seed)
    ours = Sampler(GenOptions(temperature=1.0, top_k=k), V).process(x)
    assert_same_filter(ours, hf([TopKLogitsWarper(k)], x))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.95])
def test_top_p_matches_hf(seed, p):
    x = rand_logits(seed)
    ours = Sampler(GenOptions(temperature=1.0, top_k=0, top_p=p), V).process(x)
    assert_same_filter(ours, hf([TopPLogitsWarper(p)], x))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("m", [0.01, 0.1, 0.5, 0.9])
def test_min_p_matches_hf(seed, m):
    x = rand_logits(seed)
    ours = Sampler(GenOptions(temperature=1.0, top_k=0, min_p=m), V).process(x)
    assert_same_filter(ours, hf([MinPLogitsWarper(m)], x))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf(seed, penalty):
    x = rand_logits(seed)
    rng = np.random.default_rng(seed + 100)
    tokens = rng.integers(0, V, size=30).tolist()
    n_prompt = 12
    greedy = GenOptions(temperature=0.0, repetition_penalty=penalty)
    ours = Sampler(greedy, V).process(x, tokens, n_prompt)
    assert_same_filter(ours, hf([RepetitionPenaltyLogitsProcessor(penalty)], x, tokens))
    # penalize_prompt=False == HF's prompt_ignore_length
    ours = Sampler(greedy.replace(penalize_prompt=False), V).process(x, tokens, n_prompt)
    ref = hf([RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=n_prompt)], x, tokens)
    assert_same_filter(ours, ref)
    # a window looks at the last w ids only
    ours = Sampler(greedy.replace(repetition_window=7), V).process(x, tokens, n_prompt)
    assert_same_filter(ours, hf([RepetitionPenaltyLogitsProcessor(penalty)], x, tokens[-7:]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_hf(seed, n):
    x = rand_logits(seed)
    # a small alphabet so n-grams really repeat
    tokens = np.random.default_rng(seed).integers(0, 6, size=40).tolist()
    tokens += tokens[: n - 1]  # the tail repeats the first (n-1)-gram: at least one ban
    ours = Sampler(GenOptions(temperature=0.0, no_repeat_ngram=n), V).process(x, tokens, 0)
    ref = hf([NoRepeatNGramLogitsProcessor(n)], x, tokens)
    assert_same_filter(ours, ref)
    assert np.isinf(ref).any()  # the case is not vacuous


def test_no_repeat_ngram_short_history_bans_nothing():
    assert no_repeat_ngram_bans([1, 2], 4).size == 0


@pytest.mark.parametrize("seed", range(4))
def test_full_chain_matches_hf(seed):
    x = rand_logits(seed)
    tokens = np.random.default_rng(seed).integers(0, 8, size=25).tolist()
    opts = GenOptions(
        temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3, no_repeat_ngram=2
    )
    ours = Sampler(opts, V).process(x, tokens, 5)
    ref = hf(
        [
            RepetitionPenaltyLogitsProcessor(1.3),
            NoRepeatNGramLogitsProcessor(2),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(20),
            TopPLogitsWarper(0.8),
            MinPLogitsWarper(0.05),
        ],
        x,
        tokens,
    )
    assert_same_filter(ours, ref)


# --- masks and the draw --------------------------------------------------------------------------


def test_banned_tokens_never_drawn_and_eos_held_until_min_tokens():
    x = rand_logits(4)
    x[3] = 50.0  # EOS dominates
    x[11] = 49.0
    opts = GenOptions(temperature=0.0, min_tokens=2, banned_tokens=(11,), eos_tokens=(3,))
    s = Sampler(opts, V)
    prompt = [1, 2]
    assert s.sample(x, prompt, 2) != 3  # 0 generated < min_tokens
    assert s.sample(x, prompt + [7], 2) != 3  # 1 generated
    assert s.sample(x, prompt + [7, 8], 2) == 3  # min_tokens reached
    flat = np.zeros(V, dtype=np.float32)
    d = draws(GenOptions(temperature=1.0, top_k=0, seed=1, banned_tokens=(0, 1, 2)), flat, 500)
    assert not set(d) & {0, 1, 2}


def test_empirical_distribution_matches_softmax():
    """20k draws vs softmax(logits / T): Pearson chi-square below the 1e-4 upper quantile."""
    v, t, n = 20, 0.8, 20000
    x = rand_logits(7, v, scale=1.0)
    p = torch.softmax(torch.from_numpy(x).double() / t, dim=-1).numpy()
    s = Sampler(GenOptions(temperature=t, top_k=0, seed=2024), v)
    counts = np.bincount([s.sample(x) for _ in range(n)], minlength=v)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    df, z = v - 1, 3.719  # z for an upper tail of 1e-4; Wilson-Hilferty quantile below
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, (chi2, bound)
    # and it is a real test: a different temperature is rejected
    q = torch.softmax(torch.from_numpy(x).double() / 1.6, dim=-1).numpy()
    assert float(((counts - n * q) ** 2 / (n * q)).sum()) > bound


def test_top_k_filtered_draws_stay_in_the_kept_set():
    x = rand_logits(8)
    kept = set(np.argsort(-x)[:5].tolist())
    d = draws(GenOptions(temperature=2.0, top_k=5, seed=3), x, 400)
    assert set(d) <= kept and len(set(d)) == 5
