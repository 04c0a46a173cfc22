"""Tensor parallelism over MPI (issue #15): TP = 2 and 3 against TP = 1, the CLI, faults.

Every multi-rank run is `mpiexec -n N python -m mpi4py tests/tp_worker.py ...` from the venv
(the `mpi` / `test` extras install mpi4py and the mpich wheel), bounded by MPIEXEC_TIMEOUT.
The TP = 1 reference is the same worker code run in this process on the unsplit model.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from poly.runtime.comm import SingleProcess  # noqa: E402
from tests import tp_worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "tp_worker.py")
ARCHS = ("llama", "qwen2", "qwen3")  # GQA; biases; q/k norm
TIMEOUT_S = 120


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.is_file() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (pip install 'polyloom[mpi]')")
    return found


def _env(timeout: int = TIMEOUT_S) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(
        MPIEXEC_TIMEOUT=str(timeout),  # a hung rank ends the job
        POLY_NUM_THREADS="1",  # 2-3 ranks share 2 cores
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
    )
    return env


def mpirun(n: int, *args: str, timeout: int = TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    return subprocess.run(
        cmd, env=_env(timeout), capture_output=True, text=True, timeout=timeout + 30, **kw
    )


def check_tp(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_specs(tmp_path_factory) -> list[str]:
    """llama / qwen2 / qwen3 with 6 query heads over 3 KV heads (TP = 2 splits the KV groups
    2 + 1, TP = 3 one each) and an intermediate size of 128 (43 + 43 + 42 at TP = 3)."""
    from tests.hf_fixtures import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("tp_tiny")
    over = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
    return [str(make_tiny_checkpoint(base / a, a, config_overrides=over)) for a in ARCHS]


def reference_tp(tmp: Path, quantized: bool, specs: list[str]) -> Path:
    ref = tmp / "ref"
    ref.mkdir()
    tp_worker.mode_logits(SingleProcess(), ref, quantized, specs)
    return ref


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory, tiny_specs) -> Path:
    return reference_tp(tmp_path_factory.mktemp("tiny_ref"), False, tiny_specs)


@pytest.fixture(scope="module")
def smol_f32(tmp_path_factory, smollm2_gguf) -> str:
    """SmolLM2 as a float32 .entity: memory-mapped, so each rank reads only its slices."""
    import entity

    dst = tmp_path_factory.mktemp("smol") / "smollm2.f32.entity"
    entity.convert(smollm2_gguf, dst, quant="f32")
    return str(dst)


@pytest.fixture(scope="module")
def smol_refs(tmp_path_factory, smol_f32, smollm2_gguf) -> dict:
    """quant -> (spec, TP = 1 reference dir)."""
    out = {}
    for quant, spec in (("f", smol_f32), ("q", str(smollm2_gguf))):
        out[quant] = (spec, reference_tp(tmp_path_factory.mktemp(f"ref_{quant}"), True, [spec]))
    return out


def compare_tp(ref: Path, got: Path) -> float:
    """Largest |difference| relative to the largest |logit|, over every saved run."""
    worst = 0.0
    files = sorted(ref.glob("*.npy"))
    assert files and [f.name for f in files] == sorted(f.name for f in got.glob("*.npy"))
    for f in files:
        a, b = np.load(f), np.load(got / f.name)
        assert a.shape == b.shape
        worst = max(worst, float(np.abs(a - b).max() / max(1.0, np.abs(a).max())))
    return worst


@pytest.mark.parametrize("n", [2, 3])
def test_tiny_models_logits_match_tp1(tmp_path, tiny_specs, tiny_ref, n):
    """Prefill (every position), fused decode, the Python path (numpy backend) and batched
    rows: TP = n logits equal TP = 1 within 1e-5 of the logit scale."""
    ref = tiny_ref
    out = tmp_path / "tp"
    out.mkdir()
    check_tp(mpirun(n, WORKER, "logits", str(out), "f", *tiny_specs))
    assert compare_tp(ref, out) <= 1e-5


def test_tiny_models_float16_kv_cache_matches_tp1(tmp_path, tiny_specs, tiny_ref):
    """`kv_cache_dtype = "f16"` on every rank's shard: TP = 2 logits within 1e-4 of the logit
    scale of TP = 1's with the same float16 caches (a key rounded to float16 moves a half-ulp
    when the ranks' float32 sums differ in the last bit), 10x closer than to the float32
    caches' logits (measured 2.5e-5 against 8.6e-4)."""
    ref = tmp_path / "ref"
    ref.mkdir()
    tp_worker.mode_logits(SingleProcess(), ref, False, tiny_specs, "f16")
    out = tmp_path / "tp"
    out.mkdir()
    check_tp(mpirun(2, WORKER, "logits", str(out), "h", *tiny_specs))
    same, f32 = compare_tp(ref, out), compare_tp(tiny_ref, out)
    assert same <= 1e-4 and 10 * same <= f32 <= 1e-2


@pytest.mark.real_model
@pytest.mark.parametrize("quant", ["f", "q"], ids=["f32", "q4_1_blocks"])
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_smollm2_logits_match_tp1(tmp_path, smol_refs, quant, n):
    """SmolLM2-135M: 9 heads over 3 KV heads (TP = 3: one KV group each; TP = 2: 2 + 1), in
    float32 (a memory-mapped .entity) and in its GGUF Q4_1 blocks (kept as blocks, cut on
    32-weight block boundaries)."""
    spec, ref = smol_refs[quant]
    out = tmp_path / "tp"
    out.mkdir()
    check_tp(mpirun(n, WORKER, "logits", str(out), "q", spec))
    assert compare_tp(ref, out) <= 1e-5


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_f16_int8_loom_q4_match_tp1(tmp_path, smol_f32):
    """The other stored forms (.entity f16, int8 rows, Loom Q4 blocks) split at TP = 2."""
    import entity

    specs = []
    for quant in ("f16", "q8", "q4"):
        specs.append(str(tmp_path / f"smol.{quant}.entity"))
        entity.convert(smol_f32, specs[-1], quant=quant)
    ref = reference_tp(tmp_path, True, specs)
    out = tmp_path / "tp"
    out.mkdir()
    check_tp(mpirun(2, WORKER, "logits", str(out), "q", *specs))
    assert compare_tp(ref, out) <= 1e-5


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("quant", ["f", "q"], ids=["f32", "q4_1_blocks"])
def test_smollm2_greedy_64_identical_tp123(tmp_path, smol_refs, quant):
    spec = smol_refs[quant][0]
    model = tp_worker.load(spec, SingleProcess(), True)
    want = tp_worker.greedy(model, model.prompt_ids(tp_worker.SMOL_CHAT, chat=True), 64)
    for n in (2, 3):
        out = tmp_path / f"tp{n}"
        out.mkdir()
        check_tp(mpirun(n, WORKER, "greedy", str(out), "q", spec))
        got = [int(t) for t in (out / "greedy.txt").read_text().split()]
        assert got == want, f"TP={n}"


# --- the CLI ------------------------------------------------------------------------------------


def _lucy(n: int, *argv: str, fail_rank: int = -1, **kw) -> subprocess.CompletedProcess:
    return mpirun(n, WORKER, "lucy", "-", str(fail_rank), *argv, **kw)


@pytest.mark.parametrize("kv", [(), ("--kv-cache", "f16")], ids=["kv-f32", "kv-f16"])
def test_cli_generate_tp2_matches_tp1(tiny_specs, kv):
    import json

    from lucy.cli import run

    args = ["generate", tiny_specs[0], "--prompt", "The quick brown fox", "--greedy"]
    args += ["--max-tokens", "12", "--json", *kv]
    proc = _lucy(2, *args, "--tp", "2")
    check_tp(proc)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tp"] == 2 and len(proc.stdout.strip().splitlines()) == 1  # rank 0 prints
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run(args) == 0
    want = json.loads(buf.getvalue())
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]


def test_cli_tp_must_match_world(tiny_specs):
    proc = _lucy(2, "generate", tiny_specs[0], "--prompt", "x", "--tp", "3")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lucy:")]
    assert lines == [
        "lucy: error: --tp 3 does not match the MPI world of 2 process(es); launch: "
        "mpiexec -n 3 python -m mpi4py -m lucy ... --tp 3"
    ]


def test_cli_ranks_disagreeing_on_tp_fail_at_once(tiny_specs):
    """Issue 56 item 5: rank 0 with --tp 2 and rank 1 with --tp 1 under one mpiexec spun at
    100 % CPU until killed; now the first collective compares them and the job ends, one line."""
    rank = [sys.executable, "-m", "mpi4py", WORKER, "lucy", "-", "-1", "generate", tiny_specs[0],
            "--prompt", "x", "--tp"]  # fmt: skip
    cmd = [_mpiexec(), "-n", "1", *rank, "2", ":", "-n", "1", *rank, "1"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=_env(60), capture_output=True, text=True, timeout=90)
    assert time.monotonic() - t0 < 45 and proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lucy:")]
    assert lines == [
        "lucy: error: the ranks disagree on --tp (rank 0 --tp 2, rank 1 --tp 1); launch: "
        "mpiexec -n 2 python -m mpi4py -m lucy ... --tp 2"
    ]


def test_cli_exception_on_one_rank_ends_the_job(tiny_specs):
    args = ["generate", tiny_specs[0], "--prompt", "The quick brown fox", "--greedy"]
    t0 = time.monotonic()
    proc = _lucy(2, *args, "--max-tokens", "30", "--tp", "2", fail_rank=1, timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lucy:")]
    assert lines == ["lucy: error: rank 1 of 2: RuntimeError: injected failure"]


# --- faults -------------------------------------------------------------------------------------


def _start_fault(tmp_path: Path, kind: str, spec: str, timeout: int):
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", WORKER, "fault"]
    cmd += [str(tmp_path), kind, spec]
    proc = subprocess.Popen(
        cmd, env=_env(timeout), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the workers never got going"
        time.sleep(0.1)
    return proc, [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "gone"


def _ends_within(proc, pids: list[int], seconds: float) -> tuple[int, str]:
    """(exit code, stdout + stderr) of a job that must end within `seconds`, no rank left."""
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the job did not end within {seconds} s")
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "a rank survived the job"
    return proc.returncode, out + err


def test_sigkill_of_one_rank_ends_all_ranks(tmp_path, tiny_specs):
    proc, pids = _start_fault(tmp_path, "kill", tiny_specs[0], TIMEOUT_S)
    os.kill(pids[1], signal.SIGKILL)
    code, out = _ends_within(proc, pids, 10)
    assert code != 0
    assert "EXIT STRING: Killed (signal 9)" in out  # mpiexec names what happened


def test_hung_rank_ends_through_mpiexec_timeout(tmp_path, tiny_specs):
    t0 = time.monotonic()
    proc, pids = _start_fault(tmp_path, "hang", tiny_specs[0], 8)
    code, out = _ends_within(proc, pids, 8 + 10 - (time.monotonic() - t0))
    assert "APPLICATION TIMED OUT, TIMEOUT = 8s" in out
    # 255; hydra now and then loses the ranks' exit status and exits 0 (seen once in a fresh-clone
    # CI: pmodels/mpich#7057), so the banner and no rank left are what this asserts on
    assert code in (0, 255), out[-2000:]


def test_lockstep_followers_load_no_tokenizer(smol_f32):
    """Driven from rank 0 (lockstep=True), a follower skips the tokenizer and chat template; rank
    0 and the SPMD default (every rank may tokenize) keep them. One rank of a world of one: the
    model itself comes back, so no mpiexec is needed."""
    import types

    import entity

    follower = types.SimpleNamespace(rank=1, size=1)
    lean = entity.load(smol_f32, tp=follower, lockstep=True)
    assert lean.tokenizer is None and lean.chat_template is None
    assert entity.load(smol_f32, tp=follower).tokenizer is not None  # SPMD: keeps it
    lead = entity.load(smol_f32, tp=types.SimpleNamespace(rank=0, size=1), lockstep=True)
    assert lead.tokenizer is not None and lead.chat_template is not None
    ids = [1, 2, 3, 4]
    np.testing.assert_array_equal(lean.forward(ids), lead.forward(ids))
