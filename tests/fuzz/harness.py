"""Parser targets and the fuzz budget shared by the hypothesis suite (and runnable by hand).

A *target* takes bytes, writes them to a file, parses them, and touches everything the parse
returned (every tensor, every metadata value), so lazy code paths are exercised too. The only
acceptable outcomes are success or a ``PolyError``.

Budget: ``POLY_FUZZ_EXAMPLES`` examples per property (default 300: the CI mode, derandomized, no
example database). Long mode, e.g. ``POLY_FUZZ_EXAMPLES=100000 python -m pytest tests/fuzz``:
randomized and with hypothesis' example database so failures are replayed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings

DEFAULT_EXAMPLES = 300
EXAMPLES = int(os.environ.get("POLY_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
CI_MODE = EXAMPLES <= DEFAULT_EXAMPLES

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=CI_MODE,
    database=None if CI_MODE else settings.default.database,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],  # fmt: skip
    print_blob=True,
)

# Properties whose single example is slow (a reference writer in the loop): a third of the budget.
FUZZ_SLOW = settings(FUZZ, max_examples=max(10, EXAMPLES // 3))

_SCRATCH = Path(tempfile.mkdtemp(prefix="poly-fuzz-"))


def scratch_file(name: str, data: bytes) -> Path:
    p = _SCRATCH / name
    p.write_bytes(data)
    return p


def _touch_safetensors(data: bytes) -> None:
    from entity.hf.safetensors_io import SafetensorsFile

    f = SafetensorsFile(scratch_file("x.safetensors", data))
    for name in f.names():
        arr = f.tensor(name)
        np.asarray(arr).sum()
        if f.infos[name].dtype in ("F32", "F16", "BF16", "F64"):
            f.tensor_f32(name)


def _touch_safetensors_header(data: bytes) -> None:
    from entity.hf.safetensors_io import parse_header

    parse_header(data)


def _touch_gguf(data: bytes) -> None:
    from entity.gguf.reader import GGUFFile

    gg = GGUFFile(scratch_file("x.gguf", data))
    for name in gg.tensors:
        gg.tensor_array(name)
        gg.dequantize(name)
    for value in gg.metadata.values():
        repr(value)


def _touch_gguf_model(data: bytes) -> None:
    from entity.gguf.loader import load_gguf

    tf = load_gguf(scratch_file("m.gguf", data), keep_quantized=True, max_seq_len=16)
    tf.forward([0])


def _touch_entity(data: bytes) -> None:
    from entity.dotentity.container import EntityFile

    ef = EntityFile(scratch_file("x.entity", data))
    for name in ef.blobs:
        np.asarray(ef.array(name)).sum()


def _touch_load(data: bytes) -> None:
    from entity.load import load

    load(scratch_file("any.bin", data), max_seq_len=16)


TARGETS: dict[str, Callable[[bytes], Any]] = {
    "safetensors": _touch_safetensors,
    "safetensors_header": _touch_safetensors_header,
    "gguf": _touch_gguf,
    "gguf_model": _touch_gguf_model,
    "entity": _touch_entity,
    "load": _touch_load,
}


def run_target(name: str, data: bytes) -> BaseException | None:
    """Run one target; returns the PolyError raised (or None). Anything else propagates."""
    import warnings

    from poly.errors import PolyError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # overflow in casts of garbage data
            TARGETS[name](data)
    except PolyError as exc:
        str(exc).encode("utf-8")  # the message itself must be printable
        return exc
    return None
