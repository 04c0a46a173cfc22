"""Check the --bpw sensitivity proxy against measured KL on SmolLM2-135M-Instruct (issue 59).

For a sample of tensors, each one ALONE is quantized (imatrix-weighted Q4_0) in the float32
model and the mean KL divergence of the next-token distribution from float32 is measured on the
evaluation text (Botchan, as benchmarks/quant_quality.py); the Spearman rank correlation with
the proxy entity.quantize uses (relative imatrix-weighted output error of sampled rows) and with
the absolute weighted error is reported.

    python -m benchmarks.quant_sensitivity [--tokens 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.quant_calibrated import HF, TEXT

OUT = Path(__file__).parent / "results" / "quant-sensitivity-smollm2.json"
LAYERS = (0, 3, 7, 11, 15, 19, 23, 27, 29)
ROLES = ("attn.w_q", "attn.w_k", "attn.w_v", "attn.w_o", "mlp.w_gate", "mlp.w_up", "mlp.w_down")


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    from poly.text.evaluate import log_softmax

    p, q = log_softmax(ref.astype(np.float64)), log_softmax(got.astype(np.float64))
    return float((np.exp(p) * (p - q)).sum(axis=1).mean())


def _rank(a) -> np.ndarray:
    return np.argsort(np.argsort(a)).astype(np.float64)


def main(argv: list[str] | None = None) -> int:
    import entity
    from entity.quantize import Planner
    from poly.model.imatrix import matrices
    from poly.quant.ggml import GGMLType
    from poly.quant.weighted import quantize
    from poly.text.evaluate import text_tokens

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, nargs="*", default=list(LAYERS))
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = TEXT.read_text(encoding="utf-8-sig")
    tf = entity.load(HF)
    ids = text_tokens(tf, text[text.index("CHAPTER I") :])[: args.tokens]
    planner = Planner(HF)
    mats = matrices(tf)
    tf.reset()
    ref = tf.forward_all(ids)
    names = [f"blocks.{i}.{r}" for i in args.layers for r in ROLES] + ["embeddings"]
    rows = []
    for name in names:
        w = mats[name]
        keep = np.array(w, copy=True)
        imx = planner.imatrix.get(name)
        _, deq = quantize(keep, GGMLType.Q4_0, imx)
        q = np.ones(w.shape[1]) if imx is None else imx.astype(np.float64)
        err = float(np.square(keep - deq, dtype=np.float64).sum(axis=0) @ q)
        energy = float(np.square(keep, dtype=np.float64).sum(axis=0) @ q)
        w[...] = deq
        tf.reset()
        kl = _kl(ref, tf.forward_all(ids))
        w[...] = keep
        rows.append({"tensor": name, "kl": kl, "rel_err": err / energy, "abs_err": err})
        print(json.dumps(rows[-1]), flush=True)
    kl = _rank([r["kl"] for r in rows])
    out = {"tokens": len(ids), "type": "Q4_0 (imatrix)", "tensors": rows}
    for key in ("rel_err", "abs_err"):
        out[f"spearman_{key}"] = float(np.corrcoef(kl, _rank([r[key] for r in rows]))[0, 1])
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print({k: v for k, v in out.items() if k.startswith("spearman")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
