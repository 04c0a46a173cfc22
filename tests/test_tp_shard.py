"""Partition rules and the slicing of every matrix form (no MPI needed)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from poly.config import TransformerConfig
from poly.errors import TensorParallelError
from poly.quant.qtensor import CodedMatrix, DenseMatrix, GGUFMatrix, Q4Matrix
from poly.runtime import comm as comm_mod
from poly.runtime.shard import col_grain, cols, head_ranges, make_split, rows


def test_heads_split_by_whole_kv_groups():
    # SmolLM2: 9 heads over 3 KV heads
    assert [head_ranges(9, 3, 3, r) for r in range(3)] == [
        ((0, 3), (0, 1)),
        ((3, 6), (1, 2)),
        ((6, 9), (2, 3)),
    ]
    assert [head_ranges(9, 3, 2, r) for r in range(2)] == [((0, 3), (0, 1)), ((3, 9), (1, 3))]
    # more ranks than KV heads: each KV head on size/kv ranks, its query heads split
    assert [head_ranges(8, 2, 4, r) for r in range(4)] == [
        ((0, 2), (0, 1)),
        ((2, 4), (0, 1)),
        ((4, 6), (1, 2)),
        ((6, 8), (1, 2)),
    ]


def test_heads_that_cannot_be_split_name_the_numbers():
    with pytest.raises(TensorParallelError, match="4 ranks cannot share 3 KV heads"):
        head_ranges(9, 3, 4, 0)
    with pytest.raises(TensorParallelError, match="2 query heads over 2 KV heads give 1"):
        head_ranges(2, 2, 4, 0)


def test_intermediate_split_in_whole_blocks():
    cfg = TransformerConfig(
        vocab_size=10, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4
    )
    assert [make_split(cfg, 3, r, 32).inter for r in range(3)] == [(0, 32), (32, 64), (64, 96)]
    assert make_split(cfg, 3, 0, 32).vocab_counts == (3, 3, 4)
    with pytest.raises(
        TensorParallelError, match="intermediate size 96 holds 3 blocks of 32: too few for 4"
    ):
        make_split(cfg, 4, 0, 32)


def _gguf(w: np.ndarray, qtype) -> GGUFMatrix:
    return GGUFMatrix(gguf_quants.quantize(w, qtype), qtype, w.shape)


@pytest.mark.parametrize(
    "make",
    [
        lambda w: w,
        DenseMatrix,
        lambda w: DenseMatrix(w.astype(np.float16)),
        lambda w: _gguf(w, GGMLQuantizationType.Q4_1),
        lambda w: _gguf(w, GGMLQuantizationType.Q8_0),
        Q4Matrix.quantize,
        lambda w: CodedMatrix.encode(w, "int8"),
        lambda w: CodedMatrix.encode(w, "int4"),
    ],
    ids=["ndarray", "f32", "f16", "gguf_q4_1", "gguf_q8_0", "loom_q4", "int8", "int4"],
)
def test_row_and_column_cuts_keep_the_stored_values(make):
    w = np.random.default_rng(0).standard_normal((12, 128)).astype(np.float32)
    m = make(w)
    full = m if isinstance(m, np.ndarray) else m.dequantize()
    r = rows(m, 3, 9)
    assert np.array_equal(r if isinstance(r, np.ndarray) else r.dequantize(), full[3:9])
    g = col_grain(m)
    c = cols(m, 2 * g if g > 1 else 32, 96)
    a = 2 * g if g > 1 else 32
    assert np.array_equal(c if isinstance(c, np.ndarray) else c.dequantize(), full[:, a:96])
    assert type(c) is type(m)  # kept in its form (GGUF blocks stay blocks)


def test_a_cut_inside_a_block_is_refused():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    with pytest.raises(TensorParallelError, match="splits its 32-weight blocks"):
        cols(_gguf(w, GGMLQuantizationType.Q4_1), 16, 64)


def test_single_process_is_the_default():
    c = comm_mod.SingleProcess()
    buf = np.ones(3, np.float32)
    c.allreduce(buf)
    assert c.rank == 0 and c.size == 1 and buf.tolist() == [1, 1, 1]
    assert c.bcast({"a": 1}) == {"a": 1}


def test_the_default_communicator_imports_no_mpi():
    import subprocess
    import sys

    code = "import sys, poly, poly.runtime.comm, poly.runtime.tp; print('mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the split model in one process: N threads as N ranks (no MPI) ------------------------------


class ThreadComm(comm_mod.SingleProcess):
    """Rank `rank` of `size` threads sharing `slots`; collectives meet at a barrier."""

    def __init__(self, rank, size, shared):
        super().__init__()
        self.rank, self.size, self.shared = rank, size, shared

    def _meet(self, value):
        slots, barrier = self.shared
        slots[self.rank] = value
        barrier.wait()
        got = list(slots)
        barrier.wait()
        return got

    def allreduce(self, buf):
        buf[...] = np.sum(self._meet(buf.copy()), axis=0)

    def allgather_cols(self, local, counts):
        return np.concatenate(self._meet(local.copy()), axis=1)

    def gather_cols(self, local, counts):
        got = self.allgather_cols(local, counts)
        return got if self.rank == 0 else None

    def bcast(self, obj, root=0):
        return self._meet(obj)[root]


def run_steps(model):
    ids = [5, 17, 33, 60, 2, 9]
    out = [model.forward_all(ids)]
    for tok in (7, 8, 9):
        out.append(model.forward([tok])[None])
    states = [model.new_state(), model.new_state()]
    out.append(model.forward_batch([ids[:3], ids[:5]], states))
    out.append(model.forward_batch([[11], [12]], states))
    return np.concatenate(out)


@pytest.fixture
def tiny():
    from tests.tiny_model import random_transformer

    cfg = TransformerConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=128,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3,
        attention_bias=True,
        qk_norm=True,
    )
    return random_transformer(cfg, seed=1)


@pytest.mark.parametrize("n", [2, 3])
def test_thread_ranks_match_the_whole_model(tiny, n, c_backend):
    from poly.runtime.tp import shard

    want = run_steps(tiny)
    tiny.reset()
    got = in_threads(n, lambda r, comm: run_steps(shard(tiny, comm)))
    for r in range(n):
        assert np.abs(got[r] - want).max() <= 1e-5 * np.abs(want).max()


def in_threads(n, fn):
    """fn(rank, comm) on n threads -> their results (the first error re-raised)."""
    import threading

    shared = ([None] * n, threading.Barrier(n, timeout=60))
    got, errors = [None] * n, []

    def rank(r):
        try:
            got[r] = fn(r, ThreadComm(r, n, shared))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            shared[1].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return got


def _lead_steps(model):
    """Calls a leading rank can make (forward_batch without states: fresh sequences)."""
    out = [model.forward_all([5, 17, 33]), model.forward([7])[None]]
    model.truncate(2)
    out.append(model.forward([8, 9])[None])
    out.append(model.forward_batch([[1, 2, 3], [4, 5]]))  # one by one
    out.append(model.forward_batch([[11], [12]]))  # one batched step
    model.reset()
    return np.concatenate(out)


def test_lockstep_rank0_drives_the_others(tiny, c_backend):
    """Rank 0 alone calls the model (prefill, decode, rollback, batches, greedy generation);
    the others replay its calls; rank 0 gets the whole model's logits and tokens."""
    from poly.runtime import lockstep
    from poly.runtime.tp import shard

    want = _lead_steps(tiny)
    want_text = tiny.generate([5, 6, 7], max_tokens=6, temperature=0).tokens

    def rank(r, comm):
        model = shard(tiny, comm)
        if r:
            return lockstep.follow(model)
        lockstep.lead(model)
        out = _lead_steps(model), model.generate([5, 6, 7], max_tokens=6, temperature=0).tokens
        lockstep.finish(model)
        return out

    got = in_threads(3, rank)
    assert np.abs(got[0][0] - want).max() <= 1e-5 * np.abs(want).max()
    assert got[0][1] == want_text
    assert got[1] == got[2] > 0  # calls replayed


def test_an_error_in_the_all_reduce_leaves_the_fused_step(tiny, c_backend):
    from poly.runtime import fused
    from poly.runtime.tp import shard

    class Failing(comm_mod.SingleProcess):
        size = 2

        def allreduce(self, buf):
            raise RuntimeError("link down")

        def allgather_cols(self, local, counts):
            return local

    model = shard(tiny, Failing())
    assert fused.plan(model) is not None  # the C step runs on the shard
    with pytest.raises(RuntimeError, match="link down"):
        model.forward([3])
