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

A prefill (BLAS sgemm on dequantized tiles, C passes) suffers the same way: on this machine
under load a 47-token SmolLM2 prompt took 5-30 s with 2 BLAS threads and 0.7-1.0 s with one.
`PrefillTuner` picks the count per block: every block of a prefill does the same work, so their
times compare (see its docstring). Both tuners share what they found (`Shared`): a decode that
follows a prefill which found fewer threads faster starts on fewer threads, and vice versa.
"""

from __future__ import annotations

import os
import time

WINDOW = 4  # steps per measurement
SLOW = 1.5  # slowdown against the best window that starts a trial
GAIN = 0.9  # a trial count is kept when its window is at least 10 % faster
RECHECK = 64  # steps on fewer threads before trying all threads again
MAX_RECHECK = 1024
GAP = 0.001  # seconds between reads of the run queue


def _median(times: list[float]) -> float:
    import statistics  # imported when a tuner first decides (it pulls in fractions, decimal)

    return statistics.median(times)


def adaptive() -> bool:
    return os.environ.get("POLY_ADAPTIVE_THREADS", "1") != "0"


class Shared:
    """The latest finding of any tuner: with `full` configured threads, `threads` were faster."""

    def __init__(self) -> None:
        self.full = self.threads = 0

    def found(self, full: int, threads: int) -> None:
        self.full, self.threads = full, threads

    def advice(self, full: int) -> int:
        return self.threads if self.full == full and 0 < self.threads < full else full


SHARED = Shared()  # the process-wide one (the fused step and the prefill use it)


class ThreadTuner:
    """One per model plan and batch size: `threads(full)` before a step, `record()` after."""

    def __init__(self, full: int = 0, shared: Shared | None = None) -> None:
        self.full = self.current = full
        self.shared = shared
        self.best: dict[int, float] = {}
        self.recent: list[float] = []
        self.trial: tuple[int, list[float]] | None = None
        self.calibrated = False
        self.wait = self.recheck = RECHECK
        if shared is not None and full > 1 and shared.advice(full) < full:
            # a prefill found load: start on fewer threads, look for room again after a window
            self.current, self.calibrated, self.wait = shared.advice(full), True, WINDOW

    def threads(self, full: int) -> int:
        if not adaptive() or full <= 1:
            return full
        if full != self.full:  # first step, or the thread setting changed: start over
            self.__init__(full, self.shared)
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
        med = _median(self.recent)
        best = self.best[threads] = min(self.best.get(threads, med), med)
        if threads == self.full and (not self.calibrated or med > SLOW * best):
            self.calibrated = True
            self.trial = (threads - 1, [])
        elif threads < self.full:
            self.wait -= 1
            if self.wait <= 0 and room_for(self.full):
                self.trial = (self.full, [])
            elif self.wait <= 0:  # other processes still hold the cores: no slow try
                self.wait = self.recheck

    def _record_trial(self, seconds: float) -> None:
        threads, times = self.trial
        times.append(seconds)
        base = _median(self.recent)
        retry = threads == self.full
        if retry and seconds > SLOW * base:  # still loaded: stop at once, wait longer next time
            self.trial = None
            self.recheck = self.wait = min(2 * self.recheck, MAX_RECHECK)
            return
        if len(times) < WINDOW:
            return
        self.trial = None
        ours = _median(times)
        self.best[threads] = min(self.best.get(threads, ours), ours)
        if ours < GAIN * base:
            self.current, self.recent = threads, []
            self.wait = self.recheck = RECHECK
            if self.shared is not None:
                self.shared.found(self.full, threads)
        elif retry:
            self.recheck = self.wait = min(2 * self.recheck, MAX_RECHECK)
        else:  # fewer threads are not faster: the slowdown is the work (longer context)
            self.best[self.current] = base


def others_running(samples: int = 12) -> int | None:
    """Runnable threads on the machine that are not this process's (Linux: procs_running in
    /proc/stat minus our own threads in state R), the least of up to `samples` reads `GAP` s
    apart: a kernel thread that runs for a moment is not load, nor a peer's thread pool that
    spins 5-7 ms after its work (llama.cpp's, measured). None where /proc is not readable. A
    quiet machine costs one read, a loaded one `samples * GAP` seconds."""
    least = _others_once()
    for _ in range(samples - 1):
        if not least:
            break
        time.sleep(GAP)
        seen = _others_once()
        least = None if seen is None else min(least, seen)
    return least


def _others_once() -> int | None:
    try:
        before = _own_running()
        with open("/proc/stat", "rb") as f:
            running = int(f.read().split(b"procs_running", 1)[1].split()[0])
        # our BLAS threads spin for a few ms after a GEMM, then sleep: one counted in
        # procs_running may be asleep by the next read, so take our larger count
        return max(0, running - max(before, _own_running()))
    except (OSError, ValueError, IndexError):
        return None


def _own_running() -> int:
    own = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except FileNotFoundError:  # a thread that ended between listdir and open
            continue
        own += stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"R"
    return own


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def room_for(threads: int) -> bool:
    """Whether `threads` threads would each find a free core now (unknown: assume yes). A trial
    on all threads while other processes hold the cores costs ~0.3-3 s per block here."""
    others = others_running()
    return others is None or others + threads <= cores()


class PrefillTuner:
    """Threads for the blocks of one model's prefills: `full` or `full - 1` (`low`).

    When other processes leave no room for `full` threads (`room_for`), the prefill runs on
    low. Otherwise the first prefill (and any after one that ran on low) starts with a trial:
    its blocks, which all do the same work (so their times compare), alternate low and full
    for blocks 0-3 (low first: cheap) and the faster count runs the rest; a full block
    `PREFILL_SLOW` times slower than a low one ends the trial at once. Once full was found faster, later
    prefills skip the trial and run on full while a block's time per token stays within
    `PREFILL_SLOW` of the median of the latest `RECENT_BLOCKS` full blocks (not the best ever:
    one block that did less work would make every later one look slow); `WATCH_SLOW` slower
    blocks in a row mean load the snapshot missed: low for the rest.
    The decision is shared (`Shared`) with the decode step's tuner. Use:
    `pace = tuner.begin(full, tokens)`, then `pace.threads(i)` before block i,
    `pace.record(i, threads, seconds)` after it, `pace.end()`.
    """

    def __init__(self, shared: Shared | None = None) -> None:
        self.shared = shared
        self.current = 0  # the last decision (0: none yet)
        self.recent: list[float] = []  # seconds per token of the latest full blocks not slow

    def reference(self) -> float:
        """Seconds per token of a full block, the median of the recent ones (0: none yet)."""
        return _median(self.recent) if self.recent else 0.0

    def begin(self, full: int, tokens: int = 1) -> PrefillPace:
        return PrefillPace(self, full, max(1, tokens))

    def decided(self, full: int, threads: int) -> None:
        self.current = threads
        if self.shared is not None:
            self.shared.found(full, threads)


PREFILL_TRIAL = 4  # blocks: low, full, low, full
WATCH_SLOW = 2  # consecutive slow full blocks that mean load (one can be an interrupt)
RECENT_BLOCKS = 9  # full blocks whose median time per token is the watch's reference
# A block slower than this many times the reference means load. Load costs 10-100x here (two
# BLAS threads wait at every barrier for a core); noise after a decode step reached 2.5x.
PREFILL_SLOW = 4.0


class PrefillPace:
    """The thread count of each block of one prefill (see `PrefillTuner`)."""

    def __init__(self, tuner: PrefillTuner, full: int, tokens: int = 1) -> None:
        self.tuner, self.full, self.low, self.tokens = tuner, full, max(1, full - 1), tokens
        self.times: dict[int, list[float]] = {self.low: [], full: []}
        self.trial, self.watch, self.chosen, self.slow = False, False, full, 0
        if adaptive() and full > 1:
            if not room_for(full):
                self._decide(self.low)
            elif tuner.current == full and tuner.recent:
                self.watch = True  # full was faster before: no trial, watch for load
            else:
                self.trial = True

    def threads(self, i: int) -> int:
        if self.trial and i < PREFILL_TRIAL:
            return self.low if i % 2 == 0 else self.full
        return self.chosen

    def record(self, i: int, threads: int, seconds: float) -> None:
        lows = self.times[self.low]
        # a trial's full block this much slower than a low one: loaded after all
        loaded = self.trial and threads == self.full and lows and seconds > PREFILL_SLOW * min(lows)
        if threads == self.full and threads > 1:
            self._full_block(seconds, bool(loaded))
        if not self.trial or threads not in self.times:
            return
        self.times[threads].append(seconds)
        if loaded:
            self._decide(self.low)  # no more full blocks in this prefill
        elif i + 1 >= PREFILL_TRIAL:
            self.end()

    def _full_block(self, seconds: float, loaded: bool) -> None:
        tuner, per_token = self.tuner, seconds / self.tokens
        ref = tuner.reference()
        slow = self.watch and ref > 0 and per_token > PREFILL_SLOW * ref
        self.slow = self.slow + 1 if slow else 0
        if self.slow >= WATCH_SLOW:  # far slower than full threads lately: load appeared
            self.watch = False
            self._decide(self.low)
        elif not (slow or loaded):  # a loaded block is no reference
            tuner.recent = [*tuner.recent[-(RECENT_BLOCKS - 1) :], per_token]

    def _decide(self, threads: int) -> None:
        self.trial, self.chosen = False, threads
        self.tuner.decided(self.full, threads)

    def end(self) -> None:
        """Decide on what the trial measured (a prefill may have fewer blocks than the trial)."""
        lows, fulls = self.times[self.low], self.times[self.full]
        if self.trial and lows and fulls:
            faster = sum(fulls) / len(fulls) < sum(lows) / len(lows)
            self._decide(self.full if faster else self.low)
