"""poly.runtime.threadtune's decode and prefill tuners on synthetic step times (the decisions, not the
machine): `others_running` is replaced, so the machine's real load never decides."""

from __future__ import annotations

import pytest

from poly.runtime import threadtune
from poly.runtime.threadtune import (
    PREFILL_TRIAL,
    RECHECK,
    WINDOW,
    PrefillTuner,
    Shared,
    ThreadTuner,
)

LOAD = {"others": 0}  # runnable threads of other processes, as the tuners see it
REAL_OTHERS_RUNNING = threadtune.others_running


@pytest.fixture(autouse=True)
def fake_load(monkeypatch):
    LOAD["others"] = 0
    monkeypatch.setattr(threadtune, "others_running", lambda: LOAD["others"])
    monkeypatch.setattr(threadtune, "cores", lambda: 2)


def _run(tuner: ThreadTuner, cost, steps: int, full: int = 2) -> list[int]:
    """Drive `steps` decode steps where a step on t threads takes cost(t, step) seconds."""
    used = []
    for i in range(steps):
        t = tuner.threads(full)
        used.append(t)
        tuner.record(t, cost(t, i))
    return used


def test_quiet_machine_keeps_all_threads_after_one_trial_window():
    used = _run(ThreadTuner(), lambda t, i: 0.006 if t == 2 else 0.011, 200)
    assert used[:WINDOW] == [2] * WINDOW
    assert used[WINDOW : 2 * WINDOW] == [1] * WINDOW  # the one calibration window
    assert used[2 * WINDOW :] == [2] * (200 - 2 * WINDOW)


def test_busy_core_moves_to_fewer_threads_and_back_when_the_load_is_gone():
    def cost(t, i):
        loaded = i < 150
        return (0.5 if loaded else 0.006) if t == 2 else 0.014

    used = _run(ThreadTuner(), cost, 400)
    assert used[2 * WINDOW : 2 * WINDOW + 20] == [1] * 20
    assert used[-50:] == [2] * 50  # a later re-check found all threads fast again
    slow_steps = sum(1 for i, t in enumerate(used) if t == 2 and i < 150)
    assert slow_steps <= WINDOW + 2  # each failed re-check costs one step, not a window


def test_failed_rechecks_back_off():
    tuner = ThreadTuner()
    used = _run(tuner, lambda t, i: 0.5 if t == 2 else 0.014, 2000)
    tries = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[0] >= 2 * RECHECK - 1 and gaps == sorted(gaps)  # waits double
    assert len(tries) <= 6


def test_load_arriving_later_triggers_a_trial():
    used = _run(ThreadTuner(), lambda t, i: (0.006 if i < 100 else 0.03) if t == 2 else 0.014, 160)
    assert 1 in used[100:120] and used[-10:] == [1] * 10


def test_switch_off_and_thread_change(monkeypatch):
    monkeypatch.setenv("POLY_ADAPTIVE_THREADS", "0")
    assert set(_run(ThreadTuner(), lambda t, i: 0.5 if t == 2 else 0.01, 50)) == {2}
    monkeypatch.delenv("POLY_ADAPTIVE_THREADS")
    tuner = ThreadTuner()
    _run(tuner, lambda t, i: 0.5 if t > 1 else 0.01, 20)
    assert tuner.current == 1
    assert tuner.threads(4) == 4 and tuner.full == 4  # a new setting starts over
    assert _run(tuner, lambda t, i: 0.01, 5, full=1) == [1] * 5
    assert threadtune.MAX_RECHECK >= RECHECK


def _prefill(tuner: PrefillTuner, cost, blocks: int = 30, full: int = 2) -> list[int]:
    """One prefill of `blocks` blocks where a block on t threads takes cost(t, i) seconds."""
    pace, used = tuner.begin(full), []
    for i in range(blocks):
        t = pace.threads(i)
        used.append(t)
        pace.record(i, t, cost(t, i))
    pace.end()
    return used


def test_prefill_on_a_quiet_machine_uses_all_threads_after_a_short_trial():
    shared = Shared()
    tuner = PrefillTuner(shared)
    used = _prefill(tuner, lambda t, i: 0.005 if t == 2 else 0.008)
    assert used[:PREFILL_TRIAL] == [1, 2, 1, 2] and used[PREFILL_TRIAL:] == [2] * 26
    assert tuner.current == 2 and shared.advice(2) == 2
    assert ThreadTuner(shared=shared).threads(2) == 2


def test_prefill_with_the_cores_taken_runs_on_fewer_threads_and_tells_the_decode_step():
    shared = Shared()
    tuner = PrefillTuner(shared)
    LOAD["others"] = 1  # one core busy: two threads would share it
    assert _prefill(tuner, lambda t, i: 0.5 if t == 2 else 0.02) == [1] * 30
    assert shared.advice(2) == 1
    decode = ThreadTuner(shared=shared)
    assert [decode.threads(2) for _ in range(3)] == [1, 1, 1]  # no slow first window
    LOAD["others"] = 0  # the load is gone: the next prefill measures again
    used = _prefill(tuner, lambda t, i: 0.005 if t == 2 else 0.008)
    assert used[PREFILL_TRIAL:] == [2] * 26 and shared.advice(2) == 2


def test_prefill_after_full_was_faster_skips_the_trial_and_watches_for_load():
    """A second prefill runs every block on all threads (no trial: the trial's slow blocks cost
    ~3 % of a short prompt); one slow block is noise, two in a row mean load: fewer threads."""
    shared = Shared()
    tuner = PrefillTuner(shared)
    quiet = lambda t, i: 0.005 if t == 2 else 0.008  # noqa: E731
    _prefill(tuner, quiet)
    assert _prefill(tuner, quiet) == [2] * 30
    blip = lambda t, i: 0.05 if (t, i) == (2, 7) else quiet(t, i)  # noqa: E731
    assert _prefill(tuner, blip) == [2] * 30
    load = lambda t, i: 0.05 if t == 2 and i >= 10 else quiet(t, i)  # noqa: E731
    assert _prefill(tuner, load) == [2] * 12 + [1] * 18
    assert tuner.current == 1 and shared.advice(2) == 1
    used = _prefill(tuner, quiet)  # after a low decision, the next prefill measures again
    assert used[:PREFILL_TRIAL] == [1, 2, 1, 2] and used[PREFILL_TRIAL:] == [2] * 26


def test_prefill_watch_compares_time_per_token():
    """A longer prompt takes longer per block but not per token: no switch."""
    tuner = PrefillTuner()
    pace = tuner.begin(2, tokens=10)
    for i in range(30):
        pace.record(i, pace.threads(i), 0.01 if pace.threads(i) == 2 else 0.016)
    pace.end()
    pace = tuner.begin(2, tokens=40)  # 4x the tokens, 4x the time per block
    used = []
    for i in range(30):
        used.append(pace.threads(i))
        pace.record(i, used[-1], 0.04)
    assert used == [2] * 30


def test_prefill_watch_is_not_set_off_by_one_cheap_block():
    """One full block far cheaper than the rest (a block that did less work: a cut last block, an
    MoE layer whose tokens met few experts) is no reference: the median of the recent ones is."""
    tuner = PrefillTuner()
    quiet = lambda t, i: 0.005 if t == 2 else 0.008  # noqa: E731
    _prefill(tuner, quiet)
    cheap = lambda t, i: 0.0005 if i == 29 else quiet(t, i)  # noqa: E731
    assert _prefill(tuner, cheap) == [2] * 30
    assert _prefill(tuner, quiet) == [2] * 30  # the best ever was 10x faster than these
    load = lambda t, i: 0.05 if t == 2 and i >= 3 else quiet(t, i)  # noqa: E731
    assert _prefill(tuner, load) == [2] * 5 + [1] * 25  # real load is still seen


def test_prefill_trials_loaded_full_block_is_no_reference():
    """The trial's full block that showed load does not enter the watch's reference: a later
    loaded prefill is still seen as loaded."""
    tuner = PrefillTuner()
    assert _prefill(tuner, lambda t, i: 2.0 if t == 2 else 0.02) == [1, 2] + [1] * 28
    assert tuner.recent == []
    quiet = lambda t, i: 0.005 if t == 2 else 0.008  # noqa: E731
    _prefill(tuner, quiet)
    assert max(tuner.recent) == pytest.approx(0.005)
    load = lambda t, i: 0.05 if t == 2 and i >= 3 else quiet(t, i)  # noqa: E731
    assert _prefill(tuner, load) == [2] * 5 + [1] * 25


def test_prefill_trial_stops_at_the_first_slow_full_block():
    """Load the snapshot missed: one slow block, then the rest on fewer threads."""
    used = _prefill(PrefillTuner(), lambda t, i: 2.0 if t == 2 else 0.02)
    assert used == [1, 2] + [1] * 28


def test_prefill_shorter_than_the_trial_and_switch_off(monkeypatch):
    tuner = PrefillTuner()
    assert _prefill(tuner, lambda t, i: 0.005 if t == 2 else 0.008, blocks=2) == [1, 2]
    assert tuner.current == 2
    assert _prefill(PrefillTuner(), lambda t, i: 0.01, full=1) == [1] * 30
    monkeypatch.setenv("POLY_ADAPTIVE_THREADS", "0")
    LOAD["others"] = 5
    assert _prefill(PrefillTuner(), lambda t, i: 0.5 if t == 2 else 0.01) == [2] * 30


def test_decode_recheck_waits_while_the_cores_are_taken():
    tuner = ThreadTuner()
    used = _run(tuner, lambda t, i: 0.5 if t == 2 else 0.014, 2 * WINDOW)
    assert used[-1] == 1
    LOAD["others"] = 1
    used = _run(tuner, lambda t, i: 0.5 if t == 2 else 0.014, 4 * RECHECK)
    assert used == [1] * (4 * RECHECK)  # no retry (and no slow step) while there is no room
    LOAD["others"] = 0
    used = _run(tuner, lambda t, i: 0.006 if t == 2 else 0.014, 2 * RECHECK)
    assert used[-10:] == [2] * 10


def test_others_running_reads_the_machine():
    n = REAL_OTHERS_RUNNING()
    assert n is None or n >= 0


@pytest.mark.parametrize("others", [0, 1])
def test_prefill_pacing_keeps_the_numbers_and_restores_the_threads(monkeypatch, others):
    """A prompt through the paced blocks gives the logits of the unpaced reference path (bitwise:
    the thread count only splits the work), and the configured count is back afterwards."""
    import numpy as np

    from poly import TransformerConfig
    from poly.runtime import dispatch, kernels
    from tests.tiny_model import random_transformer

    # long prompts on the paced blocks, as a wide model's
    monkeypatch.setattr(dispatch, "SMALL_WIDTH", 0)

    cfg = TransformerConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_layers=6,
                            num_heads=4, num_kv_heads=2, max_seq_len=128)  # fmt: skip
    tf = random_transformer(cfg, seed=3)
    ids = list(range(5, 75))  # 70 rows: past the fused prompt rows, the paced reference path
    ref = tf.reference_forward(ids)
    monkeypatch.setattr(kernels, "num_threads", lambda: 2)
    LOAD["others"] = others
    tf.reset()
    used = []
    monkeypatch.setattr(kernels, "use_threads", lambda n: used.append(n))
    got = tf.forward(ids)
    np.testing.assert_array_equal(got, ref)
    assert used[-1] == 2  # the configured count is in force again
    assert used[0] == 1 and (others == 0) == (2 in used[:-1])  # busy: never all threads
    assert tf.prefill_tuner.current in ((1,) if others else (1, 2))


def test_use_threads_sets_blas_and_c_without_changing_the_setting():
    from threadpoolctl import threadpool_info

    from poly.runtime import ckernels, kernels

    full = kernels.num_threads()
    try:
        for n in (1, 3):
            kernels.use_threads(n)
            infos = [i for i in threadpool_info() if i["user_api"] == "blas"]
            ours = [i for i in infos if "numpy" in i["filepath"]] or infos  # numpy's own
            blas = {i["num_threads"] for i in ours}
            assert blas == {kernels.blas_threads(n)}  # 1 under the C backend (blas_threads)
            if kernels.backend() == "c":
                assert ckernels.info()["threads"] == n
            assert kernels.num_threads() == full
    finally:
        kernels.use_threads(full)


def test_decode_started_on_fewer_threads_looks_for_room_after_one_window():
    """A prefill's finding may be a moment's load: the decode checks again after a window."""
    shared = Shared()
    shared.found(2, 1)
    used = _run(ThreadTuner(shared=shared), lambda t, i: 0.006 if t == 2 else 0.014, 4 * WINDOW)
    assert used[:WINDOW] == [1] * WINDOW and used[-WINDOW:] == [2] * WINDOW
    assert shared.advice(2) == 2


@pytest.mark.parametrize("busy", [False, True])
def test_short_prompt_takes_fewer_threads_only_while_others_run(busy, monkeypatch):
    """The fused prefill follows a tuner's "fewer threads" finding only while other processes
    hold the cores; on a quiet machine the finding is stale and all threads run."""
    from poly import TransformerConfig
    from poly.runtime import ckernels, fused, kernels, prefill
    from tests.tiny_model import random_transformer

    cfg = TransformerConfig(hidden_size=64, intermediate_size=96, vocab_size=120, num_layers=2,
                            num_heads=4, num_kv_heads=2, max_seq_len=64)  # fmt: skip
    tf = random_transformer(cfg, seed=3)
    seen = []
    real = ckernels.decode
    monkeypatch.setattr(ckernels, "decode", lambda *a: (seen.append(a[6]), real(*a))[1])
    monkeypatch.setattr(prefill, "room_for", lambda threads: not busy)
    monkeypatch.setattr(fused.SHARED, "full", 0)
    before = kernels.num_threads()
    kernels.set_num_threads(2)
    fused.SHARED.found(2, 1)  # a decode tuner found one thread faster, some time ago
    try:
        tf.forward([3, 17, 5, 42, 9])
    finally:
        fused.SHARED.found(0, 0)
        kernels.set_num_threads(before)
    assert seen == [1 if busy else 2]


class _PaceSpy:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before(self, i: int) -> None:
        self.calls.append(("before", i))

    def after(self, i: int) -> None:
        self.calls.append(("after", i))


def test_the_reference_prefill_does_not_time_its_cut_last_block():
    """A prompt's last block runs its FFN on the last row only (hidden_states(last=True)): far
    less work than the other blocks, so the prefill tuner must not take its time as a block's.
    It did in session 33: its best time per token became the cut block's, every full block of
    a later prompt looked 4x slow, and a 1B Q8_0 512-token prompt fell to one thread (62 -> 42
    tok/s) every other prompt."""
    from tests.tiny_model import random_transformer, tiny_cfg

    tf = random_transformer(tiny_cfg(), seed=1)
    spy = _PaceSpy()
    tf.reset()
    tf.reference_forward([1, 2, 3, 4], spy)
    assert spy.calls == [("before", 0), ("after", 0), ("before", 1), ("after", 1), ("before", 2)]
    spy = _PaceSpy()
    tf.reset()
    tf.hidden_states([1, 2, 3, 4], spy)  # every row through every block: each one timed
    assert [c for c in spy.calls if c[0] == "after"] == [("after", 0), ("after", 1), ("after", 2)]
