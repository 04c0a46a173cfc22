"""Counters of the serving scheduler (read by ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metrics:
    requests: int = 0  # submitted
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0  # queue full
    tokens: int = 0  # generated
    prompt_tokens: int = 0  # prefilled (prefix-cache hits excluded)
    prefix_hit_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of rows over decode steps (occupancy = rows / steps)
    decode_s: float = 0.0
    prefill_s: float = 0.0

    def decode_step(self, rows: int, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_s += seconds

    def prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_tokens += tokens
        self.prefill_s += seconds
