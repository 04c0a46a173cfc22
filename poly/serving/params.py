"""Per-request sampling parameters of the serving scheduler (OpenAI's fields, validated)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from poly.errors import SamplingParamsError
from poly.text.dry import DEFAULT_BREAKERS
from poly.text.sampling import GenOptions

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20


def _num(name: str, v, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SamplingParamsError(f"{name} must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise SamplingParamsError(f"{name} must be in [{lo}, {hi}], got {v!r}")
    return float(v)


def _int(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingParamsError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise SamplingParamsError(f"{name} must be {bound}, got {v!r}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``max_tokens`` None = up to the context length.

    ``temperature`` 0 is greedy (pure argmax of the penalised logits). ``logprobs`` None = off,
    k >= 0 = the sampled token's log-probability plus the k most likely alternatives (log-softmax
    of the raw model logits, before penalties, temperature and masks). ``seed`` makes sampling
    reproducible; choice i of a request with ``n`` > 1 uses seed + i.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0  # GenOptions' (0 = the whole context); llama.cpp's repeat_last_n
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS
    penalize_prompt: bool = True  # the penalties look at prompt + reply (False: the reply only)
    logprobs: int | None = None
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _num("temperature", self.temperature, 0.0, 100.0)
        if self.top_p <= 0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _num("top_p", self.top_p, 0.0, 1.0)
        _int("top_k", self.top_k, 0)
        _num("min_p", self.min_p, 0.0, 0.999999)
        if self.seed is not None:
            _int("seed", self.seed, 0)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(f"stop must be a string or a list of strings, got {stop!r}")
        if len(stop) > 16:
            raise SamplingParamsError("stop takes at most 16 strings")
        object.__setattr__(self, "stop", tuple(stop))
        _int("n", self.n, 1, MAX_N)
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _num("repetition_penalty", self.repetition_penalty, 1e-3, 100.0)
        # the DRY fields and the window, checked (and the breakers made a tuple) as GenOptions does
        breakers = self.gen_options(0, 1).dry_sequence_breakers
        object.__setattr__(self, "dry_sequence_breakers", breakers)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def gen_options(self, index: int, budget: int) -> GenOptions:
        """The poly GenOptions of choice ``index`` with ``budget`` new tokens."""
        seed = None if self.seed is None else self.seed + index
        return GenOptions(
            max_tokens=budget,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_window=self.repetition_window,
            dry_multiplier=self.dry_multiplier,
            dry_base=self.dry_base,
            dry_allowed_length=self.dry_allowed_length,
            dry_penalty_last_n=self.dry_penalty_last_n,
            dry_sequence_breakers=self.dry_sequence_breakers,
            penalize_prompt=self.penalize_prompt,
            seed=seed,
            eos_tokens=() if self.ignore_eos else None,
        )
