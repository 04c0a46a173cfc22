"""Speculative decoding (poly.text.speculative): prompt lookup and draft models.

Greedy: the tokens equal plain decoding's (and transformers' greedy) on 20 prompts, with lookup,
with the q8 .entity of the same weights as the draft and with an unrelated draft. Sampling: the
acceptance rule keeps the target distribution (chi-square on a 4-token vocabulary).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import entity
import poly.text  # noqa: F401 - installs the stream hook
from poly.errors import SpeculationError
from poly.text.sampling import GenOptions, Sampler
from poly.text.speculative import Speculation, accept, lookup_tokens
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint
from tests.tiny_model import random_transformer, tiny_cfg

N_PROMPTS = 20


def chisquare_p(observed, expected) -> float:
    """Pearson's chi-square test's p-value (the survival function by torch's regularized
    incomplete gamma: scipy is not a dependency)."""
    import torch

    obs, exp = np.asarray(observed, float), np.asarray(expected, float)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(f32 model, its q8 .entity, an unrelated model with the same vocabulary, snapshot dir)."""
    base = tmp_path_factory.mktemp("spec")
    src = make_tiny_checkpoint(base / "hf", "llama", seed=0)
    other = make_tiny_checkpoint(base / "other", "llama", seed=7)
    q8 = entity.convert(src, base / "tiny.q8.entity", quant="q8").dst
    return entity.load(src), entity.load(q8), entity.load(other), src


@pytest.fixture
def one_thread():
    """One C thread: a tiny model's many generations skip the per-prompt look at the load."""
    from poly.runtime import kernels

    old = kernels.num_threads()
    kernels.set_num_threads(1)
    yield
    kernels.set_num_threads(old)


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (lookup finds n-grams in them) and random ones."""
    rng = np.random.default_rng(61)
    out = []
    for i in range(N_PROMPTS):
        part = rng.integers(3, vocab, size=int(rng.integers(4, 12))).tolist()
        out.append(part * 3 if i % 2 == 0 else part)
    return out


GREEDY = dict(temperature=0.0, max_tokens=16, min_tokens=16)  # no EOS stop: all 16 compared


def test_greedy_lookup_and_draft_equal_plain_decoding(tiny, one_thread):
    model, q8, other, src = tiny
    accepted = {"lookup": 0, "q8": 0}
    for i, ids in enumerate(_prompts(model.config.vocab_size)):
        plain = model.generate(ids, **GREEDY).tokens
        look = model.generate(ids, lookup=6, **GREEDY)
        draft = model.generate(ids, draft=q8, draft_tokens=5, **GREEDY)
        unrelated = model.generate(ids, draft=other, draft_tokens=3, **GREEDY)
        assert look.tokens == plain, f"prompt {i}: lookup"
        assert draft.tokens == plain, f"prompt {i}: q8 draft"
        assert unrelated.tokens == plain, f"prompt {i}: unrelated draft"
        if i < 4:  # the reference: transformers' greedy decoding of the same checkpoint
            assert list(plain) == hf_greedy(src, ids, len(plain))
        accepted["lookup"] += look.speculative["accepted"]
        accepted["q8"] += draft.speculative["accepted"]
        assert model.position == len(ids) + len(plain) - 1  # as plain decoding leaves it
    # the paths that keep proposals ran (not only rejections)
    assert accepted["lookup"] > 0 and accepted["q8"] > 100, accepted


def test_early_stop_leaves_the_cache_as_plain_decoding(tiny):
    model, q8, _, _ = tiny
    ids = _prompts(model.config.vocab_size)[0]
    plain = model.generate(ids, temperature=0.0, max_tokens=9, min_tokens=9)
    pos = model.position
    for kw in ({"lookup": 8}, {"draft": q8, "draft_tokens": 8}):
        with model.stream(ids, temperature=0.0, max_tokens=9, min_tokens=9, **kw) as stream:
            got = [e.token_id for e in itertools.islice(stream, 4)]
        assert got == list(plain.tokens[:4]) and model.position == len(ids) + 3
        done = model.generate(ids, temperature=0.0, max_tokens=9, min_tokens=9, **kw)
        assert done.tokens == plain.tokens and model.position == pos


def test_lookup_tokens_take_the_first_longest_match_sized_by_it():
    # 2-gram [2, 3] first at 1: its followers, 2 x 2 + 1 = 5 of them at most
    seq = [1, 2, 3, 9, 8, 7, 6, 5, 4, 1, 2, 3, 7, 5, 2, 3]
    assert lookup_tokens(seq, 8) == [9, 8, 7, 6, 5]
    assert lookup_tokens(seq, 2) == [9, 8]
    assert lookup_tokens(seq, 8, ngram=1) == [9, 8, 7]  # a 1-gram earns 3
    assert lookup_tokens([4, 5, 6, 4], 3) == [5, 6, 4]
    assert lookup_tokens([1, 2, 3], 4) == []


# --- sampling: the rule keeps the target distribution ------------------------------------------


def _tiny_vocab_model(seed: int):
    return random_transformer(tiny_cfg(vocab_size=4, max_seq_len=64), seed=seed, head_scale=2.0)


def test_acceptance_rule_keeps_the_target_distribution():
    """The first token of a checked pass follows the target's p whatever the proposal: a
    point mass (lookup) on a likely and an unlikely token, and a draft's own distribution."""
    target, drafter = _tiny_vocab_model(1), _tiny_vocab_model(2)
    opts = GenOptions(temperature=1.0, top_k=0, seed=5)
    ids = [0, 1, 2, 3, 1]
    rows = target.forward_all(ids)[-2:]  # row 0 scores the proposal, row 1 the next token
    sampler = Sampler(opts, 4)
    p = sampler.probabilities(rows[0], ids[:-1], 0)
    q = Sampler(opts, 4).probabilities(drafter.forward_all(ids)[-2], ids[:-1], 0)
    trials = 4000
    for proposal, qs in (([int(np.argmax(p))], []), ([int(np.argmin(p))], []), ([2], [q])):
        counts = np.zeros(4)
        for _ in range(trials):
            acc, nxt = accept(sampler, rows, proposal, qs, ids[:-1], 0)
            counts[(acc + [nxt])[0]] += 1
        assert chisquare_p(counts, p * trials) > 1e-3, (proposal, counts / trials, p)


def test_sampled_lookup_generation_keeps_the_joint_distribution(one_thread):
    """End to end: (t0, t1) of `generate(lookup=...)` at temperature 1, t1 from a checked pass,
    against p(t0) p(t1 | t0) from the model's own logits."""
    model = _tiny_vocab_model(3)
    ids = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    opts = dict(temperature=1.0, top_k=0, top_p=1.0, max_tokens=3, min_tokens=3)
    sampler = Sampler(GenOptions(**opts), 4)
    model.reset()
    p0 = sampler.probabilities(model.forward(ids), ids, len(ids))
    joint = np.zeros((4, 4))
    for t0 in range(4):
        model.reset()
        p1 = sampler.probabilities(model.forward(ids + [t0]), ids + [t0], len(ids))
        joint[t0] = p0[t0] * p1
    trials, counts, checks = 1000, np.zeros((4, 4)), 0
    for seed in range(trials):
        done = model.generate(ids, seed=seed, lookup=2, **opts)
        counts[done.tokens[0], done.tokens[1]] += 1
        checks += done.speculative["checks"]
    assert checks >= trials  # t1 came from a checked pass every time
    keep = joint.ravel() * trials >= 5  # chi-square needs expected counts >= 5
    rest = counts.ravel()[~keep].sum(), joint.ravel()[~keep].sum() * trials
    obs = np.append(counts.ravel()[keep], rest[0])
    exp = np.append(joint.ravel()[keep] * trials, rest[1])
    assert chisquare_p(obs, exp * obs.sum() / exp.sum()) > 1e-3


# --- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{"lookup": 0}, {"lookup": 64}, {"lookup": -1}, {"lookup": 2.5},
     {"draft": object(), "draft_tokens": 0}, {"draft_tokens": 4}],
)  # fmt: skip
def test_bad_counts_are_speculation_errors(kw):
    with pytest.raises(SpeculationError, match="1..63|needs a draft"):
        Speculation(**kw)


def test_a_draft_with_another_vocabulary_is_refused(tiny):
    model = tiny[0]
    small = random_transformer(tiny_cfg(vocab_size=model.config.vocab_size - 1))
    with pytest.raises(SpeculationError, match="vocabulary"):
        model.generate([3, 4, 5], draft=small, max_tokens=2)
    with pytest.raises(SpeculationError, match="another model object"):
        model.generate([3, 4, 5], draft=model, max_tokens=2)
    model.generate([3, 4, 5], max_tokens=2)  # the model's lock was released


def test_reference_path_checks_the_rows_too(one_thread):
    """Without the fused step (the numpy backend) the rows run on the reference path
    (`Transformer.forward_all`) and the cache rolls back all the same."""
    from poly.runtime import kernels

    model = random_transformer(tiny_cfg(max_seq_len=128), seed=11)
    draft = random_transformer(tiny_cfg(max_seq_len=128), seed=11)  # the same weights
    ids = [5, 9, 14, 5, 9, 14, 5, 9]
    old = kernels.backend()
    try:
        kernels.set_backend("numpy")
        plain = model.generate(ids, **GREEDY)
        look = model.generate(ids, lookup=5, **GREEDY)
        drafted = model.generate(ids, draft=draft, draft_tokens=4, **GREEDY)
    finally:
        kernels.set_backend(old)
    assert look.tokens == plain.tokens == drafted.tokens
    assert drafted.speculative["acceptance_rate"] == 1.0  # identical weights agree everywhere
    assert model.position == len(ids) + len(plain.tokens) - 1


def test_sampled_draft_generation_is_seeded(tiny, one_thread):
    """Sampling with a draft: the same seed gives the same tokens, another seed other ones."""
    model, q8, _, _ = tiny
    ids = _prompts(model.config.vocab_size)[0]
    opts = dict(temperature=1.0, top_k=0, max_tokens=16, min_tokens=16, draft=q8, draft_tokens=4)
    a, b = model.generate(ids, seed=1, **opts), model.generate(ids, seed=1, **opts)
    c = model.generate(ids, seed=2, **opts)
    assert a.tokens == b.tokens != c.tokens and a.speculative["checks"] > 0
