"""Stop strings over streamed text: release text as it completes, hold back a possible start."""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Releases text as it completes, holding back any tail that could start a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = ""
        self.hit = False

    def _holdback(self, buf: str) -> int:
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(len(buf), longest), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                return k
        return 0

    def push(self, piece: str) -> str:
        if not self.stops:
            return piece
        buf = self.held + piece
        cuts = [p for p in (buf.find(s) for s in self.stops) if p >= 0]
        if cuts:
            self.hit, self.held = True, ""
            return buf[: min(cuts)]
        keep = self._holdback(buf)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self, tail: str) -> str:
        out = self.push(tail)
        if not self.hit:
            out, self.held = out + self.held, ""
        return out

    def flush(self) -> str:
        """The held-back tail once the sequence ends (nothing after a stop string matched)."""
        out, self.held = ("" if self.hit else self.held), ""
        return out
