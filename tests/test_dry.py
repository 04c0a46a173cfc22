"""DRY and the repetition penalty against llama.cpp's own samplers (llama-cpp-python's libllama:
``llama_sampler_init_dry`` / ``llama_sampler_init_penalties``) on random histories and logits,
with the real SmolLM2 vocabulary for the sequence breakers."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from poly.text.dry import DEFAULT_BREAKERS, apply_dry, dry_penalties, sequence_breakers
from poly.text.sampling import GenOptions, Sampler, apply_repetition_penalty

L = pytest.importorskip("llama_cpp")

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
_QUIET = L.llama_log_callback(lambda level, text, user: None)  # kept alive: libllama calls it


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    """(llama.cpp vocab pointer, poly tokenizer) of the same GGUF."""
    from entity.gguf.reader import GGUFFile
    from entity.gguf.tokenizer import load_gguf_tokenizer

    L.llama_log_set(_QUIET, None)
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(smollm2_gguf).encode(), params)
    assert model
    tok = load_gguf_tokenizer(GGUFFile(smollm2_gguf))[0]
    yield L.llama_model_get_vocab(model), tok
    L.llama_model_free(model)


def _run(sampler, n_vocab: int, history, logits: np.ndarray) -> np.ndarray:
    """llama.cpp's sampler after it accepted ``history``, applied to ``logits`` (then reset)."""
    L.llama_sampler_reset(sampler)
    for t in history:
        L.llama_sampler_accept(sampler, int(t))
    assert ctypes.sizeof(L.llama_token_data) == _TOKEN_DATA.itemsize
    data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
    data["id"], data["logit"] = np.arange(n_vocab), logits
    ptr = data.ctypes.data_as(ctypes.POINTER(L.llama_token_data))
    arr = L.llama_token_data_array(data=ptr, size=n_vocab, selected=-1, sorted=False)
    L.llama_sampler_apply(sampler, ctypes.byref(arr))
    out = np.empty(n_vocab, dtype=np.float32)
    out[data["id"][: arr.size]] = data["logit"][: arr.size]
    return out


def llama_dry(vocab_p, mult, base, allowed, last_n, breakers):
    raw = [b.encode() for b in breakers]
    arr = (ctypes.c_char_p * len(raw))(*raw)
    return L.llama_sampler_init_dry(vocab_p, mult, base, allowed, last_n, arr, len(raw))


def _history(rng, pool, rare, n: int) -> list[int]:
    """Random ids with planted repeats (copies of earlier stretches, as a looping model makes)
    and, now and then, one of the ``rare`` ids (breakers, heads of multi-token breakers)."""
    out = [int(t) for t in rng.choice(pool, size=8)]
    while len(out) < n:
        if rng.random() < 0.5 and len(out) > 4:
            start = int(rng.integers(0, len(out) - 2))
            out += out[start : start + int(rng.integers(2, 16))]
        else:
            out += [int(t) for t in rng.choice(pool, size=int(rng.integers(1, 4)))]
        if rng.random() < 0.15:
            out.append(int(rng.choice(rare)))
    out = out[:n]
    start = int(rng.integers(0, len(out) - 1))
    return out + out[start : start + int(rng.integers(1, 10))]  # ends in the middle of a repeat


CASES = [  # (multiplier, base, allowed_length, last_n, breakers)
    (0.8, 1.75, 2, 64, DEFAULT_BREAKERS),
    (0.8, 1.75, 2, 512, DEFAULT_BREAKERS),
    (1.5, 2.0, 3, 40, ("\n",)),
    (0.5, 1.1, 0, 100, ()),
    (0.8, 1.75, 2, 300, ("assistant", "\n\n", "the end")),
    (2.0, 30.0, 1, 512, ()),  # exponents past float32's range: clamped as llama.cpp does
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_dry_matches_llama_cpp(vocab, case):
    vocab_p, tok = vocab
    mult, base, allowed, last_n, brk = CASES[case]
    rng = np.random.default_rng(case)
    # the ids that matter: breakers alone ("\n", ":", '"', "*"), heads of multi-token breakers
    rare = tok.encode(' the end\n\n:*" assistant\n', add_special_tokens=False)
    pool = np.array([t for t in range(300, 340) if t not in rare])
    breakers = sequence_breakers(tok, brk)
    penalised, ref = 0, llama_dry(vocab_p, mult, base, allowed, last_n, brk)
    for trial in range(10):
        history = _history(rng, pool, rare, int(rng.integers(5, 400)))
        logits = rng.normal(0, 3, tok.vocab_size).astype(np.float32)
        want = _run(ref, tok.vocab_size, history, logits)
        got = apply_dry(logits, *dry_penalties(history, mult, base, allowed, last_n, breakers))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"trial {trial}")
        penalised += int((want != logits).any())
    L.llama_sampler_free(ref)
    assert penalised >= 5  # the comparison is about penalties, not about doing nothing


def test_sampler_runs_dry_with_the_model_tokenizer(vocab):
    """Through `Sampler`: the same logits as llama.cpp's DRY, greedy picks the unpenalised."""
    vocab_p, tok = vocab
    history = tok.encode("A creature of the sea, a creature of the sea, a creature of the")
    logits = np.zeros(tok.vocab_size, dtype=np.float32)
    sea = tok.encode(" sea")[0]
    logits[sea], logits[tok.encode(" deep")[0]] = 5.0, 4.0
    opts = GenOptions(temperature=0.0, dry_multiplier=0.8, dry_penalty_last_n=-1)
    got = Sampler(opts, tok.vocab_size, tokenizer=tok).process(logits, history, len(history))
    ref = llama_dry(vocab_p, 0.8, 1.75, 2, len(history), DEFAULT_BREAKERS)
    want = _run(ref, tok.vocab_size, history, logits)
    L.llama_sampler_free(ref)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[sea] < 4.0  # " sea" would extend a 10-token repeat
    assert Sampler(opts, tok.vocab_size, tokenizer=tok).sample(logits, history) != sea


@pytest.mark.parametrize("penalty,last_n", [(1.3, 64), (1.1, 16), (0.8, 200)])
def test_repetition_penalty_matches_llama_cpp(penalty, last_n):
    """repeat_penalty / repeat_last_n: ours over the window equals llama.cpp's penalties sampler
    (positive logits divided, the rest multiplied, once per distinct id)."""
    rng = np.random.default_rng(7)
    n_vocab = 500
    history = [int(t) for t in rng.integers(0, 120, size=300)]
    logits = rng.normal(0, 3, n_vocab).astype(np.float32)
    logits[history[-5:]] = 0.0  # the boundary: llama.cpp multiplies a logit <= 0
    sampler = L.llama_sampler_init_penalties(n_vocab, last_n, penalty, 0.0, 0.0)
    want = _run(sampler, n_vocab, history, logits)
    L.llama_sampler_free(sampler)
    ours = apply_repetition_penalty(logits, history[-last_n:], penalty)
    np.testing.assert_allclose(ours, want, rtol=1e-6)
    opts = GenOptions(temperature=0.0, repetition_penalty=penalty, repetition_window=last_n)
    np.testing.assert_allclose(Sampler(opts, n_vocab).process(logits, history), want, rtol=1e-6)


def _llama_chain(vocab_p, n_vocab: int, last_n: int, penalty: float, dry: tuple):
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    pen = L.llama_sampler_init_penalties(n_vocab, last_n, penalty, 0.0, 0.0)
    L.llama_sampler_chain_add(chain, pen)
    L.llama_sampler_chain_add(chain, llama_dry(vocab_p, *dry, DEFAULT_BREAKERS))
    return chain


# llama.cpp's names and values, and what they mean to llama.cpp's own samplers: (penalty window,
# penalty, (DRY multiplier, base, allowed length, window)); None = the whole history (-1 once,
# this libllama takes only explicit windows)
NAMED = [
    ({"repeat_penalty": 1.3, "repeat_last_n": 16, "dry_multiplier": 0.8},
     (16, 1.3, (0.8, 1.75, 2, None))),
    ({"repeat_penalty": 1.2, "repeat_last_n": -1, "dry_multiplier": 1.0, "dry_base": 2.0,
      "dry_allowed_length": 3, "dry_penalty_last_n": 50}, (None, 1.2, (1.0, 2.0, 3, 50))),
    ({"repeat_penalty": 1.5, "repeat_last_n": 0, "dry_multiplier": 0.5},
     (0, 1.5, (0.5, 1.75, 2, None))),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(NAMED)))
def test_llama_cpp_names_mean_what_llama_cpp_means(vocab, case):
    """`lucy generate --repeat-penalty ... --dry-multiplier ...` and a server request with
    llama.cpp's fields sample from the logits llama.cpp's penalties + DRY chain leaves."""
    from lucy import settings
    from lucy.cli import build_parser
    from lucy.server.protocol import parse_chat

    vocab_p, tok = vocab
    fields, (last_n, penalty, dry) = NAMED[case]
    rng = np.random.default_rng(case)
    rare = tok.encode(':\n"', add_special_tokens=False)
    history = _history(rng, np.arange(300, 340), rare, 300)
    logits = rng.normal(0, 3, tok.vocab_size).astype(np.float32)
    whole = len(history)
    dry = (*dry[:3], whole if dry[3] is None else dry[3])
    ref = _llama_chain(vocab_p, tok.vocab_size, whole if last_n is None else last_n, penalty, dry)
    want = _run(ref, tok.vocab_size, history, logits)
    L.llama_sampler_free(ref)
    argv = ["generate", "m", "--prompt", "x"]
    for name, value in fields.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    flags = settings.overrides_from_args(build_parser().parse_args(argv))
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    served = parse_chat(body).params.gen_options(0, 1)
    for opts in (GenOptions(temperature=0.0).replace(**flags), served):
        got = Sampler(opts, tok.vocab_size, tokenizer=tok).process(logits, history)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (want != logits).any()
