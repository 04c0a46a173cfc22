"""`--bpw` (entity.quantize, poly.quant.allocate): the allocation respects the size budget, a
sensitive tensor gets the larger type, the written file keeps the budget and runs close to
transformers' float32, and bad budgets are one-line CLI errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from poly.quant.allocate import Option, allocate
from tests.hf_fixtures import hf_logits, make_tiny_checkpoint


def _options(rng, n_tensors=40):
    kinds = (("A", 4.5), ("B", 5.5), ("C", 6.5), ("D", 8.5))
    out = {}
    for t in range(n_tensors):
        n = int(rng.integers(1, 50)) * 256
        base = float(rng.random()) + 1e-3
        out[f"t{t}"] = [Option(k, int(n * b / 8), base * 2.0 ** (-2 * b)) for k, b in kinds]
    return out


def test_allocation_respects_every_budget_exactly():
    rng = np.random.default_rng(0)
    opts = _options(rng)
    smallest = sum(min(o.nbytes for o in v) for v in opts.values())
    largest = sum(max(o.nbytes for o in v) for v in opts.values())
    prev = math.inf
    for budget in np.linspace(smallest, largest + 1000, 25).astype(int):
        choice = allocate(opts, int(budget))
        used = sum(o.nbytes for o in choice.values())
        assert used <= budget
        cost = sum(o.cost for o in choice.values())
        assert cost <= prev + 1e-12  # more budget never costs quality
        prev = cost
        # no single upgrade that still fits would lower the cost (the fill pass is exhaustive)
        for t, o in choice.items():
            for alt in opts[t]:
                if alt.nbytes - o.nbytes <= budget - used and alt.nbytes > o.nbytes:
                    assert alt.cost >= o.cost
    assert all(o.kind == "D" for o in allocate(opts, largest).values())


def test_sensitive_tensor_gets_the_larger_type():
    opts = _options(np.random.default_rng(1), 12)
    a, b = opts["t0"][0], opts["t0"][1]
    budget = sum(min(o.nbytes for o in v) for v in opts.values()) + (b.nbytes - a.nbytes)

    def scaled(f):
        return {**opts, "t0": [Option(o.kind, o.nbytes, o.cost * f) for o in opts["t0"]]}

    assert allocate(scaled(1e-6), budget)["t0"].kind == "A"  # insensitive: the bytes go elsewhere
    assert allocate(scaled(1e6), budget)["t0"].nbytes > a.nbytes  # sensitive: it takes them


def test_budget_below_the_smallest_types_is_an_error():
    from poly.errors import UsageError

    opts = _options(np.random.default_rng(2), 3)
    with pytest.raises(UsageError, match="below the smallest"):
        allocate(opts, 10)


def _tiny(tmp_path):
    # hidden 256: rows long enough for the 256-element K kinds too
    return make_tiny_checkpoint(
        tmp_path / "m", "llama", seed=5,
        config_overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    )  # fmt: skip


def test_bpw_file_keeps_its_budget_and_its_types(tmp_path):
    import entity
    from entity.dotentity.container import EntityFile
    from entity.quantize import Planner
    from poly.text.evaluate import parameter_count

    src = _tiny(tmp_path)
    params = parameter_count(entity.load(src))
    planner = Planner(src)  # one importance matrix for both budgets
    for bpw in (6.5, 8.0):
        dst = tmp_path / f"b{bpw}.entity"
        rep = entity.convert(src, dst, quant="q4", bpw=bpw, planner=planner)
        size = os.path.getsize(dst)
        assert size * 8 / params <= bpw + 0.05
        kinds = {kind for _, _, kind, _ in rep.recipe.table}
        ef = EntityFile(dst)  # the header names each matrix's chosen ggml type
        stored = {ef.blobs[n].ggml_type for n in rep.recipe.types}
        assert stored == {int(k) for k in rep.recipe.types.values()}
        assert kinds
    ids = [5, 17, 42, 99, 3, 250, 7, 8]
    want = hf_logits(src, ids)[-1]
    got = entity.load(dst).forward_all(ids)[-1]
    assert np.corrcoef(want, got)[0, 1] > 0.99


def _lucy(args, env_home):
    env = dict(os.environ, POLY_HOME=str(env_home), NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "lucy", *args], env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip


@pytest.mark.parametrize("bad", ["-1", "nan", "0", "abc", "0.5"])
def test_bad_budgets_are_one_line_errors(tmp_path, bad):
    src = _tiny(tmp_path) if bad == "0.5" else tmp_path  # only a real budget reads the model
    proc = _lucy(["convert", str(src), "-o", str(tmp_path / "o.entity"), f"--bpw={bad}"],
                 tmp_path / "home")  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("lucy: error: ") and "bpw" in lines[0]
    assert not (tmp_path / "o.entity").exists()


def test_measured_kl_steers_the_allocation(tmp_path):
    """The measured sensitivity (entity.sensitivity) sets the costs: a block matrix whose
    measured KL is made large gets a larger type at the same budget than when made small; the
    head's KL, computed from the final hidden states, falls with every larger type."""
    from entity.quantize import Planner

    planner = Planner(_tiny(tmp_path), measured=True)  # per tensor
    planner.recipe(6.0)  # measures once
    kl = planner.kl
    head = kl["lm_head"]
    assert head["Q8_0"] < head["Q6_K"] < head["Q5_0"] < head["Q4_0"]
    name = "blocks.1.mlp.w_up"
    kinds = {}
    for factor in (1e-6, 1e6):
        planner.kl = {**kl, name: {"Q4_0": kl[name]["Q4_0"] * factor}}
        planner.kl_options = None
        recipe = planner.recipe(6.0)
        kinds[factor] = recipe.types[name]
    size = {k: dict(_bits()).get(k.name, 0) for k in kinds.values()}
    assert size[kinds[1e6]] > size[kinds[1e-6]]


def _bits():
    from poly.quant.ggml import QUANT_SIZES, GGMLType

    return [(k.name, s * 8 / b) for k, (b, s) in QUANT_SIZES.items() if isinstance(k, GGMLType)]


def test_grouped_measurement_steers_the_head(tmp_path):
    """The grouped measurement (two forwards, entity.sensitivity.measure_grouped) puts the head
    and the block matrices on one KL scale: the tied table's head KL made large gets it a
    larger type at the same budget than made small; the shares of the body's KL sum to it."""
    from entity.quantize import Planner

    src = make_tiny_checkpoint(
        tmp_path / "t", "llama", seed=6, tied=True,
        config_overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    )  # fmt: skip
    planner = Planner(src, measured="group")
    planner.recipe(6.0)
    kl = planner.kl
    assert set(kl["embeddings"]) == {"Q4_0", "input"} and kl["embeddings"]["Q4_0"] > 0
    assert all(set(kl[n]) == {"Q4_0"} for n in kl if n.startswith("blocks."))
    kinds = {}
    for factor in (1e-6, 1e6):
        emb = {**kl["embeddings"], "Q4_0": kl["embeddings"]["Q4_0"] * factor}
        planner.kl, planner.kl_options = {**kl, "embeddings": emb}, None
        kinds[factor] = planner.recipe(6.0).types["embeddings"]
    size = dict(_bits())
    assert size[kinds[1e6].name] > size[kinds[1e-6].name]


def test_excluded_kinds_by_tensor_prefix(tmp_path):
    """A benchmark's exclusion "KIND@prefix" keeps that kind off the named tensors only."""
    from entity.quantize import Planner

    planner = Planner(_tiny(tmp_path), measured=False)
    planner.exclude = {"Q8_0@blocks."}
    types = planner.recipe(30.0).types  # room for Q8_0 everywhere
    assert types["embeddings"].name == "Q8_0"
    assert all(k.name != "Q8_0" for n, k in types.items() if n.startswith("blocks."))
