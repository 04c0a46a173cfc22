"""Will it fit: the memory a checkpoint needs, from its headers only (`entity.load.describe`).

`footprint` splits the tensor table into the dense part (held for the whole run) and the MoE
experts (paged under a budget, `poly.runtime.expert_cache`), each counted as the loader holds
it: GGUF and `.entity` tensors as stored (mapped or read in), an HF snapshot's dense weights as
float32 masters, an expert as its stored bytes when a kernel reads them as they are, else as its
loaded copy (float32; MXFP4 as bfloat16). `fit` picks the largest expert budget and the KV cache
that fit a byte budget (``--memory 6G``) and refuses with a one-line estimate when the dense
part alone does not fit. Sizes: K/M/G and KiB/MiB/GiB are powers of 1024 (as ``docker -m``),
KB/MB/GB powers of 1000.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from poly.errors import UsageError

# Python, numpy, the tokenizer, scratch: tests/test_fit_rss.py holds the plan to within 10 % of
# real peaks
RUNTIME_BYTES = 72 << 20
MIN_CTX = 256  # the shortest KV cache `fit` shrinks to
# bytes a cached value takes, by --kv-cache: q8_0 is 32 int8 codes and a float16 scale per 32
# values (poly.nn.kvcache), not float32 (the plan had counted it as 4: 3.8x the memory)
KV_ITEM = {"f32": 4, "f16": 2, "q8_0": 34 / 32}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_EXPERT = {
    "gguf": re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down)(?:_exps|\.\d+)\.weight"),
    "entity": re.compile(r"blocks\.(\d+)\.mlp\.experts\.\d+(?:\..*)?"),
    "hf": re.compile(r".*layers\.(\d+)\..*(?:\.experts\.\d+\.\w+\.weight|\.experts\.(?:gate_up|"
                     r"down)_proj(?:_blocks|_scales)?|\.(?:input|output)_linear\.weight)"),
}  # fmt: skip


def parse_size(text: str, what: str = "--memory") -> int:
    """Bytes of "6G", "512MiB", "1.5GB", "4096" (bytes); UsageError otherwise."""
    m = _SIZE.fullmatch(str(text))
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None or float(m.group(1)) * unit < 1:
        raise UsageError(
            f"{what} {text!r} is not a size: give a number with K, M, G (KiB, MiB, GiB; or KB, "
            "MB, GB for powers of 1000), e.g. 6G"
        )
    return int(float(m.group(1)) * unit)


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Footprint:
    """What a checkpoint holds, by part (bytes)."""

    dense: int  # held for the whole run
    experts: int  # routed experts over all sparse layers
    expert_held: int  # one expert while resident (the average over the layers)
    expert_stored: int  # one expert's bytes in the file (what a miss reads)
    top_k: int
    sparse_layers: int
    transient: int  # experts a fused decode step holds past the budget (top_k per layer)
    kv_layers: tuple  # (kv_heads * head_dim, sliding window or 0) per attention layer
    # while a GGUF/.entity opens, its largest matrix is held twice (stored rows and the repacked
    # copy): a peak the KV cache, allocated later, may not reach (SmolLM2 Q4_1: its 30 MB table)
    load_extra: int = 0
    heads: int = 0  # the most query heads of an attention layer: a prefill chunk's scores

    def prefill_scratch(self, ctx: int) -> int:
        """The float32 attention scores of one prefill chunk over `ctx` positions (the run's
        peak above the KV cache: 17 MiB of SmolLM2's at 1024)."""
        from poly.model.prefill import PREFILL_CHUNK

        return 4 * self.heads * min(ctx, PREFILL_CHUNK) * ctx

    def run_bytes(self, ctx: int, item: float = 4) -> int:
        """What a run adds after loading: the KV cache and a prefill chunk's scores."""
        return self.kv_bytes(ctx, item) + self.prefill_scratch(ctx)

    def kv_bytes(self, ctx: int, item: float = 4) -> int:
        """K and V at `ctx` positions, `item` bytes a value (q8_0: KV_ITEM["q8_0"])."""
        from poly.nn.kvcache import window_rows

        return round(sum(2 * window_rows(ctx, w) * width * item for width, w in self.kv_layers))


def _held(fmt: str, t) -> tuple[int, int]:
    """(bytes held while loaded, bytes stored) of expert tensor t."""
    n = math.prod(t.shape)
    if fmt == "gguf":
        from entity.gguf.moe import dequantized_on_load

        copy = t.stored == "gguf_mxfp4" and 39 in dequantized_on_load()  # bfloat16 copies
        return (2 * n if copy else t.nbytes), t.nbytes
    if fmt == "hf":
        if t.name.endswith("_scales"):
            return 0, t.nbytes
        if t.name.endswith("_blocks"):
            return 4 * n, t.nbytes  # two values a byte, each a bfloat16
        return (t.nbytes if t.stored == "float32" else 4 * n), t.nbytes
    return t.nbytes, t.nbytes


def footprint(desc) -> Footprint:
    """The footprint of a `entity.load.Description`."""
    cfg = desc.model.config
    pattern = _EXPERT[desc.format]
    dense = held = stored = largest = 0
    for t in desc.tensors:
        if cfg.moe is not None and pattern.fullmatch(t.name):
            h, s = _held(desc.format, t)
            held, stored = held + h, stored + s
        else:
            dense += 4 * math.prod(t.shape) if desc.format == "hf" else t.nbytes
            largest = max(largest, t.nbytes)
    extra = 0 if desc.format == "hf" else largest  # HF masters are copied a piece at a time
    attn = [desc.model.attn(i) for i in range(cfg.num_layers)]
    kv = tuple(
        (a.num_kv_heads * a.head_dim, int(getattr(a, "sliding_window", 0) or 0)) for a in attn
    )
    heads = max((a.num_heads for a in attn), default=0)
    if cfg.moe is None:
        return Footprint(dense, 0, 0, 0, 0, 0, 0, kv, extra, heads)
    moe = cfg.moe
    sparse = cfg.num_layers - len(moe.dense_layers)
    count = sparse * moe.num_experts
    per, per_stored = -(-held // count), -(-stored // count)
    transient = moe.top_k * sparse  # the C step (GPT-OSS's options too) reports after it runs
    return Footprint(dense, count, per, per_stored, moe.top_k, sparse, transient, kv, extra, heads)


@dataclass(frozen=True)
class Fit:
    """A budget's plan: `max_resident` None holds every expert; `total` is the estimate."""

    memory: int
    ctx: int
    kv_bytes: int
    max_resident: int | None
    experts_bytes: int  # resident experts (budget plus the decode step's transient ones)
    dense: int
    runtime: int
    total: int
    read_per_token: int  # weight bytes a decode step reads (dense + top_k experts per layer)
    disk_per_token: int  # expert bytes a step reads from the file with uniform routing

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _need(fp: Footprint, ctx: int, n: int, item: float) -> int:
    held = min(fp.experts, n + fp.transient) * fp.expert_held
    return RUNTIME_BYTES + fp.dense + max(fp.run_bytes(ctx, item), fp.load_extra) + held


def fit(
    fp: Footprint, memory: int, ctx: int, *, ctx_fixed: bool = False, kv_item: float = 4
) -> Fit:
    """The largest expert budget (and KV context, shrunk from `ctx` unless `ctx_fixed`) whose
    estimate fits `memory`; UsageError naming the minimum when none does."""
    least = fp.top_k if fp.experts else 0
    if _need(fp, ctx, least, kv_item) > memory and not ctx_fixed:
        ctx = max(MIN_CTX, min(ctx, _largest_ctx(fp, memory, least, kv_item)))
    need = _need(fp, ctx, least, kv_item)
    m = min(fp.experts, least + fp.transient)
    if need > memory:
        raise UsageError(
            f"{human(memory)} does not fit: the dense weights need {human(fp.dense)}, the runtime "
            f"{human(RUNTIME_BYTES)}, the KV cache at {ctx} tokens {human(fp.kv_bytes(ctx, kv_item))}"
            f" and a prefill chunk's attention scores {human(fp.prefill_scratch(ctx))}"
            + (f", the {m} experts a step needs {human(m * fp.expert_held)}" if least else "")
            + f": at least {human(need)}"
        )
    n = fp.experts
    if fp.experts and _need(fp, ctx, n, kv_item) > memory:
        spare = memory - _need(fp, ctx, 0, kv_item) + min(fp.experts, fp.transient) * fp.expert_held
        n = max(least, spare // fp.expert_held - fp.transient)
    budget = None if n >= fp.experts else int(n)
    held = min(fp.experts, n + fp.transient) * fp.expert_held if fp.experts else 0
    miss = 0.0 if budget is None else 1 - budget / fp.experts
    per_step = fp.top_k * fp.sparse_layers
    return Fit(memory, ctx, fp.kv_bytes(ctx, kv_item), budget, held, fp.dense, RUNTIME_BYTES,
               _need(fp, ctx, n, kv_item), fp.dense + per_step * fp.expert_stored,
               int(per_step * miss * fp.expert_stored))  # fmt: skip


def _largest_ctx(fp: Footprint, memory: int, n: int, item: float) -> int:
    lo, hi = MIN_CTX, 1 << 22
    while lo < hi:  # the KV bytes grow with ctx: the largest ctx that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _need(fp, mid, n, item) <= memory else (lo, mid - 1)
    return lo // MIN_CTX * MIN_CTX if lo >= MIN_CTX else lo


def plan(spec, memory: int, ctx: int | None = None, kv_cache: str | None = None):
    """(Fit, Footprint) of checkpoint `spec` under `memory` bytes, from its headers."""
    from entity.load import describe

    desc = describe(spec)
    if desc is None:
        raise UsageError("a memory budget needs the headers of a GGUF, .entity v2 or HF model")
    fp = footprint(desc)
    default = desc.model.config.max_seq_len
    item = KV_ITEM.get(kv_cache or "f32", 4)
    return fit(fp, memory, ctx or default, ctx_fixed=ctx is not None, kv_item=item), fp
