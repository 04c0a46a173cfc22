"""The pure parts of benchmarks/matrix.py: roofline arithmetic, CPU description, tables.

Nothing here measures or spawns anything (tests/test_bench_matrix.py covers it)."""

from __future__ import annotations

import statistics

CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512", "amx")


# --- roofline ----------------------------------------------------------------------------------


def decode_bytes(tensors: list[tuple[str, int]]) -> int:
    """Weight bytes one decode step reads: every tensor, except the token table when the model
    has its own LM head (`output.weight`; then a step reads one row of the table). A tied model
    reads the whole table as its LM head."""
    names = {name for name, _ in tensors}
    skip = "token_embd.weight" if "output.weight" in names else None
    return sum(n for name, n in tensors if name != skip)


def ceiling_tok_s(bytes_per_token: int, bandwidth: float) -> float:
    """Decode tokens/s if every step only streamed its weights at `bandwidth` bytes/s."""
    return bandwidth / bytes_per_token


def roofline_fraction(tok_s: float, bytes_per_token: int, bandwidth: float) -> float:
    """Measured decode speed as a fraction of the memory-read ceiling (1.0 = at the ceiling)."""
    return tok_s / ceiling_tok_s(bytes_per_token, bandwidth)


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": list(xs)}


# --- machine -----------------------------------------------------------------------------------


def parse_cpuinfo(text: str) -> dict:
    """CPU model name and the SIMD flags that matter for the kernels, from /proc/cpuinfo."""
    model, flags = "unknown", []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = [f for f in value.split() if f.startswith(CPU_FLAGS)]
    return {"model": model, "flags": flags}


def header(machine: dict, args: dict) -> str:
    cpu = machine["cpu"]
    bws = machine.get("bandwidth_runs") or [machine["bandwidth"]]  # older reports: one value
    lines = [
        f"CPU: {cpu['model']} ({machine['cpus']} logical CPUs); flags: {' '.join(cpu['flags'])}",
        f"poly ISA: {machine.get('poly_isa', '?')}; llama-cpp-python {machine.get('llama_cpp')}; "
        f"load average at start {' '.join(f'{x:.1f}' for x in machine['load'])}",
        f"threads {args['threads']}, {args['runs']} alternating rounds (medians) after "
        f"{args.get('warmup', 0)} untimed warm-up run(s) of each op, "
        f"{args['new']} decode tokens; memory read bandwidth "
        f"{machine['bandwidth'] / 1e9:.1f} GB/s ({args['threads']} threads, plain read loop; the "
        f"{machine.get('bandwidth_stat', 'most')} of {len(bws)} measurements, "
        f"{min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f})",
        # reports before session 25 have no key: their llama.cpp ran on plain buffers
        f"llama.cpp weight buffers: {args.get('llama_buffers', 'plain')} (a cell marked "
        "'plain' fell back: its default buffers crashed)",
    ]
    return "\n".join(lines)


# --- tables ------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _median(entry: dict, kind: str, key) -> float | None:
    cell = entry.get(kind, {}).get(str(key))
    return None if cell is None else cell["median"]


def speed_table(cells: list[dict], args: dict, bandwidth: float) -> str:
    """One row per (precision, engine): tok/s medians, roofline fraction, load, RSS, agreement."""
    pre, ctx = args["prefill"], args["contexts"]
    cols = [f"prefill {n}" for n in pre] + [f"decode @{c}" for c in ctx]
    cols += [f"roofline @{ctx[0]}", "load s", "RSS MB", f"= f32 /{args['agree_new']}"]
    lines = ["| precision | engine | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for cell in cells:
        for name, e in cell["engines"].items():
            if "error" in e:
                lines.append(f"| {cell['precision']} | {name} | failed: {e['error']} |")
                continue
            vals = [_fmt(_median(e, "prefill", n), 0) for n in pre]
            vals += [_fmt(_median(e, "decode", c)) for c in ctx]
            d0 = _median(e, "decode", ctx[0])
            roof = None
            if d0 is not None and e.get("bytes_per_token") and bandwidth:
                roof = roofline_fraction(d0, e["bytes_per_token"], bandwidth)
            vals += [_fmt(roof, 2), _fmt(e.get("load_s"), 2), _fmt(e.get("rss_mb"), 0)]
            vals.append("-" if e.get("agree") is None else str(e["agree"]))
            fell = e.get("buffers") == "plain" and args.get("llama_buffers") == "default"
            label = f"{name} (plain)" if fell else name
            lines.append(f"| {cell['precision']} | {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def ratio(ours: dict, peer: dict, kind: str, key) -> float | None:
    a, b = _median(ours, kind, key), _median(peer, kind, key)
    return None if a is None or not b else a / b


def ratio_table(cells: list[dict], args: dict) -> str:
    """Ours (engines named poly*) over each peer of the same cell (llama, hf), median / median."""
    keys = [("prefill", n) for n in args["prefill"]] + [("decode", c) for c in args["contexts"]]
    cols = [f"prefill {k}" if kind == "prefill" else f"decode @{k}" for kind, k in keys]
    lines = ["| precision | ours / peer | " + " | ".join(cols) + " |"]
    lines.append("|---" * (len(cols) + 2) + "|")
    for cell in cells:
        engines = {n: e for n, e in cell["engines"].items() if "error" not in e}
        peers = [n for n in engines if not n.startswith("poly")]
        for name in (n for n in engines if n.startswith("poly")):
            for peer in peers:
                vals = [ratio(engines[name], engines[peer], kind, k) for kind, k in keys]
                cells_txt = " | ".join("-" if v is None else f"{v:.2f}x" for v in vals)
                lines.append(f"| {cell['precision']} | {name} / {peer} | {cells_txt} |")
    return "\n".join(lines)


def render(report: dict) -> str:
    """The whole text report: header, then per model its speed table and its ratio table."""
    args, bw = report["args"], report["machine"]["bandwidth"]
    out = [header(report["machine"], args)]
    for model in args["models"]:
        cells = [c for c in report["cells"] if c["model"] == model]
        if not cells:
            continue
        out += ["", f"## {model}", "", speed_table(cells, args, bw), ""]
        out += [f"Ratios ({model}):", "", ratio_table(cells, args)]
    return "\n".join(out)
