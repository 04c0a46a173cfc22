"""The convert report folds a MoE layer's experts into one row per layer and view."""

from __future__ import annotations

from entity.convert_report import ConvertReport, TensorStat


def test_expert_rows_fold_into_one_row_per_layer_and_view_with_the_worst_error():
    tensors = [TensorStat("blocks.0.attn.w_q", (8, 8), 0.1, 0.01)]
    for e in range(64):
        for view, shape in (("w_gate", (16, 8)), ("w_down", (8, 16))):
            tensors.append(TensorStat(f"blocks.0.mlp.experts.{e}.{view}", shape, e / 100, e / 1000))
    tensors.append(TensorStat("blocks.0.mlp.router", (64, 8), 0.0, 0.0))
    tensors.append(TensorStat("blocks.0.norm", (8,), 0.0, 0.0))  # not a matrix
    report = ConvertReport("a", "b", "q8", "gguf", verified=True, tensors=tensors)
    rows = {t.name: t for t in report.matrices()}
    assert sorted(rows) == [
        "blocks.0.attn.w_q",
        "blocks.0.mlp.experts.*(64).w_down",
        "blocks.0.mlp.experts.*(64).w_gate",
        "blocks.0.mlp.router",
    ]
    gate = rows["blocks.0.mlp.experts.*(64).w_gate"]
    assert (gate.shape, gate.max_abs, gate.rel_rms) == ((16, 8), 0.63, 0.063)
    assert len(report.format().splitlines()) == 2 + 4 + 1  # header lines, 4 rows, the worst line
    assert report.max_abs == 0.63  # the totals still see every tensor
