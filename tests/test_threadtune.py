"""poly.runtime.threadtune.ThreadTuner on synthetic step times (the decisions, not the machine)."""

from __future__ import annotations

from poly.runtime import threadtune
from poly.runtime.threadtune import RECHECK, WINDOW, ThreadTuner


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
