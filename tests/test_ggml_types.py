"""poly's GGML type table against the gguf package's (the reference we did not write)."""

from __future__ import annotations

import subprocess
import sys

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from poly.quant.ggml import QUANT_SIZES, GGMLType


def test_ids_and_block_geometry_equal_gguf_py():
    both = {t.name for t in GGMLType} & {t.name for t in GGMLQuantizationType}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"} <= both
    for name in both:
        ours, ref = GGMLType[name], GGMLQuantizationType[name]
        assert int(ours) == int(ref), name
        assert QUANT_SIZES.get(ours) == GGML_QUANT_SIZES.get(ref), name
        assert GGML_QUANT_SIZES.get(ours) == QUANT_SIZES.get(ref), name  # keys interchange


def test_loading_a_dotentity_does_not_import_gguf(tmp_path):
    """Core poly and a .entity load stay clear of the gguf package (RSS of every TP rank)."""
    code = (
        "import sys, entity, poly, lucy.cli; "
        "from poly.quant import schemes, qtensor; "
        "print('gguf' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
