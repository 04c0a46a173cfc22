"""poly.quant.schemes: one record per scheme; the tables of poly, entity and lucy read them, and
Loom's bake (loom_q4) still loads from files that named it q4_0."""

from __future__ import annotations

import numpy as np
import pytest

from entity.convert import convert
from entity.dotentity import blobs
from entity.dotentity.container import EntityFile
from entity.dotentity.read import load_entity
from lucy.cli import QUANTS
from lucy.menu import QUANT_ALIASES
from poly.quant import schemes
from poly.quant.qtensor import GGUFMatrix, Q4Matrix
from poly.runtime import ckernels
from tests.hf_fixtures import make_tiny_checkpoint


def test_records_drive_every_table():
    loom = schemes.get("loom_q4")
    assert loom.qtensor is Q4Matrix and loom.block == 32 and loom.c_kind == ckernels.LOOM_Q4
    assert schemes.get("q4_0") is loom  # the old .entity encoding name
    assert schemes.get("gguf_q4_1").qtensor is GGUFMatrix
    assert QUANTS == ("q4", "q8", "f16", "bf16", "f32")
    assert schemes.by_cli("4") is loom and QUANT_ALIASES["int8"] == "q8"
    assert blobs.SCHEMES["q4"] == ("loom_q4", "int8") and blobs.EMBED_ALIASES["q4"] == "loom_q4"
    assert set(ckernels.C_SCHEMES) == {
        n for n, r in schemes.SCHEMES.items() if r.c_kind is not None
    }
    w = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    for rec in schemes.SCHEMES.values():
        if rec.encode is not None:
            qt = rec.encode(w)
            assert qt.scheme == rec.name and isinstance(qt, rec.qtensor)
            assert rec.decode(qt).shape == w.shape


def test_a_file_that_names_the_loom_bake_q4_0_still_loads(tmp_path, monkeypatch):
    src = make_tiny_checkpoint(tmp_path / "snap", "llama", seed=5)
    new = tmp_path / "new.entity"
    convert(src, new, quant="q4", calibrate=False)  # the Loom bake, not the calibrated recipe
    assert EntityFile(new).meta("quant")["matrix"] == "loom_q4"
    old = tmp_path / "old.entity"
    monkeypatch.setitem(blobs.SCHEMES, "q4", ("q4_0", "int8"))  # what convert wrote before
    convert(src, old, quant="q4", calibrate=False)
    assert EntityFile(old).meta("quant")["matrix"] == "q4_0"
    a, b = load_entity(new), load_entity(old)
    assert isinstance(b.attn(0).weights.versions[b.attn(0).weights.active]["w_q"], Q4Matrix)
    np.testing.assert_array_equal(a.forward([1, 2, 3]), b.forward([1, 2, 3]))


def test_unknown_scheme_is_a_usage_error():
    from poly.errors import UsageError

    with pytest.raises(UsageError):
        schemes.get("q3_x")
    with pytest.raises(UsageError):
        schemes.by_cli("q3")
