"""How many threads a fused decode step uses: all of them, unless fewer are faster.

A decode step is a chain of barriers (poly/fused.py): when another process keeps one core busy,
every barrier waits for the thread the OS took off that core. On this 2-core machine, with one
busy process, 2 threads took 300-900 ms per SmolLM2 Q4_1 step and 1 thread 14 ms (quiet: 8 vs
14 ms). The tuner measures instead of guessing:

- the first `WINDOW` steps run on all threads, the next `WINDOW` on one fewer; the faster count
  (by at least `GAIN`) is kept;
- on all threads, a window `SLOW` times slower than the best seen starts another trial;
- on fewer threads, all threads are tried again after `RECHECK` steps (doubling after each
  failed try, up to `MAX_RECHECK`); a try stops at its first step if that step is slow.

On a quiet machine this costs one window of slower steps per model and batch size.
POLY_ADAPTIVE_THREADS=0 turns it off (every step then uses the configured count).
"""

from __future__ import annotations

import os
import statistics

WINDOW = 4  # steps per measurement
SLOW = 1.5  # slowdown against the best window that starts a trial
GAIN = 0.9  # a trial count is kept when its window is at least 10 % faster
RECHECK = 64  # steps on fewer threads before trying all threads again
MAX_RECHECK = 1024


class ThreadTuner:
    """One per model plan and batch size: `threads(full)` before a step, `record()` after."""

    def __init__(self, full: int = 0) -> None:
        self.full = self.current = full
        self.best: dict[int, float] = {}
        self.recent: list[float] = []
        self.trial: tuple[int, list[float]] | None = None
        self.calibrated = False
        self.wait = self.recheck = RECHECK

    def threads(self, full: int) -> int:
        if os.environ.get("POLY_ADAPTIVE_THREADS", "1") == "0" or full <= 1:
            return full
        if full != self.full:  # first step, or the thread setting changed: start over
            self.__init__(full)
        return self.trial[0] if self.trial is not None else self.current

    def record(self, threads: int, seconds: float) -> None:
        if self.trial is not None:
            if threads == self.trial[0]:
                self._record_trial(seconds)
            return
        if threads != self.current:
            return
        self.recent = [*self.recent[-(WINDOW - 1) :], seconds]
        if len(self.recent) < WINDOW:
            return
        med = statistics.median(self.recent)
        best = self.best[threads] = min(self.best.get(threads, med), med)
        if threads == self.full and (not self.calibrated or med > SLOW * best):
            self.calibrated = True
            self.trial = (threads - 1, [])
        elif threads < self.full:
            self.wait -= 1
            if self.wait <= 0:
                self.trial = (self.full, [])

    def _record_trial(self, seconds: float) -> None:
        threads, times = self.trial
        times.append(seconds)
        base = statistics.median(self.recent)
        retry = threads == self.full
        if retry and seconds > SLOW * base:  # still loaded: stop at once, wait longer next time
            self.trial = None
            self.recheck = self.wait = min(2 * self.recheck, MAX_RECHECK)
            return
        if len(times) < WINDOW:
            return
        self.trial = None
        ours = statistics.median(times)
        self.best[threads] = min(self.best.get(threads, ours), ours)
        if ours < GAIN * base:
            self.current, self.recent = threads, []
            self.wait = self.recheck = RECHECK
        elif retry:
            self.recheck = self.wait = min(2 * self.recheck, MAX_RECHECK)
        else:  # fewer threads are not faster: the slowdown is the work (longer context)
            self.best[self.current] = base
