"""/metrics: the scheduler's counters in Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import os

_HELP = {
    "requests_total": ("counter", "requests accepted into the queue"),
    "requests_finished_total": ("counter", "requests finished (cancelled included)"),
    "requests_cancelled_total": ("counter", "requests cancelled (client gone, shutdown)"),
    "requests_rejected_total": ("counter", "requests refused because the queue was full"),
    "prompt_tokens_total": ("counter", "prompt tokens prefilled (prefix-cache hits excluded)"),
    "generation_tokens_total": ("counter", "tokens generated"),
    "prefix_cache_hit_tokens_total": ("counter", "prompt tokens reused from the prefix cache"),
    "decode_steps_total": ("counter", "fused multi-row decode calls"),
    "decode_rows_total": ("counter", "rows over all decode calls"),
    "decode_seconds_total": ("counter", "seconds spent in decode calls"),
    "prefill_seconds_total": ("counter", "seconds spent in prefill passes"),
    "queue_length": ("gauge", "requests waiting to join the batch"),
    "batch_rows": ("gauge", "sequences in the running batch"),
    "batch_occupancy": ("gauge", "mean rows per decode call"),
    "kv_sequences": ("gauge", "sequences holding KV memory"),
    "kv_tokens": ("gauge", "positions cached by live sequences"),
    "kv_pages_total": ("gauge", "pages in the KV pool (allocated at start)"),
    "kv_pages_used": ("gauge", "KV pages referenced by live sequences"),
    "kv_pages_cached": ("gauge", "unreferenced KV pages kept for prefix reuse (evictable)"),
    "kv_pages_free": ("gauge", "KV pages never used or evicted"),
    "kv_page_size": ("gauge", "positions per KV page"),
    "kv_bytes_used": ("gauge", "bytes of the KV pages in use"),
    "process_resident_bytes": ("gauge", "resident set size of the server process"),
    "prompt_cache_loaded": ("counter", "prompts whose KV came from the --prompt-cache folder"),
    "prompt_cache_stored": ("counter", "prompts written to the --prompt-cache folder"),
    "spec_checks_total": ("counter", "speculative passes (a lone sequence's proposals checked)"),
    "spec_proposed_tokens_total": ("counter", "tokens proposed (--lookup or --draft)"),
    "spec_accepted_tokens_total": ("counter", "proposed tokens the model kept"),
    "spec_pass_tokens_total": ("counter", "tokens the speculative passes produced"),
    "spec_acceptance_rate": ("gauge", "accepted / proposed tokens"),
    "spec_tokens_per_pass": ("gauge", "tokens per speculative pass"),
    "spec_gain": ("gauge", "plain over speculative seconds per token (the last measurements)"),
}


def _rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def values(s) -> dict:
    m = s.metrics
    out = {
        "requests_total": m.requests,
        "requests_finished_total": m.finished,
        "requests_cancelled_total": m.cancelled,
        "requests_rejected_total": m.rejected,
        "prompt_tokens_total": m.prompt_tokens,
        "generation_tokens_total": m.tokens,
        "prefix_cache_hit_tokens_total": m.prefix_hit_tokens,
        "decode_steps_total": m.decode_steps,
        "decode_rows_total": m.decode_rows,
        "decode_seconds_total": round(m.decode_s, 6),
        "prefill_seconds_total": round(m.prefill_s, 6),
        "queue_length": s.queue_length,
        "batch_rows": s.rows,
        "batch_occupancy": (m.decode_rows / m.decode_steps) if m.decode_steps else 0.0,
    }
    for k, v in s.kv.stats().items():
        out[k] = v
    if getattr(s, "spec", None) is not None:
        out.update(s.spec.stats())
    out["process_resident_bytes"] = _rss()
    return out


def prometheus_text(scheduler, prefix: str = "poly_") -> str:
    lines = []
    for name, value in values(scheduler).items():
        kind, text = _HELP.get(name, ("gauge", name.replace("_", " ")))
        lines += [f"# HELP {prefix}{name} {text}", f"# TYPE {prefix}{name} {kind}"]
        lines.append(
            f"{prefix}{name} {float(value):g}"
            if isinstance(value, float)
            else f"{prefix}{name} {value}"
        )
    return "\n".join(lines) + "\n"
