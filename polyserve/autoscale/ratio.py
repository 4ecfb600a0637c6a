"""Busy ratio: Δ busy time / (Δ wall time x workers), from each host's usage counters."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# A host's uptime may run ahead of ours between two scrapes by scheduling jitter, never by
# more than this: beyond it, the counters are from a new boot (a restart we missed).
CLOCK_SLACK_S = 1.0
# A host's counters are unsigned 8-byte words; a figure past them is not one of its own.
COUNTER_LIMIT = 2**64


@dataclass(frozen=True)
class Sample:
    """A host's /_polyserve/usage `host` section, and when we read it (our clock)."""

    uptime_s: float
    busy_ms: int
    workers: int
    in_flight: int
    at: float

    @classmethod
    def parse(cls, answer: object, at: float) -> Sample:
        """Raises ValueError, saying what is wrong, on an answer that is not a host's usage."""
        host = answer.get("host") if isinstance(answer, dict) else None
        if not isinstance(host, dict):
            raise ValueError("no `host` object")
        return cls(
            _number(host, "uptime_s", float),
            _number(host, "busy_ms", int),
            _number(host, "workers", int),
            _number(host, "in_flight", int),
            at,
        )


def _number(host: dict[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    """One counter of a host's usage: a finite, non-negative number within the host's
    8-byte words (an integer where the host writes one). Anything else (NaN, 1e400, a
    string, a bool) is refused here: past this point it would raise in the arithmetic of
    the whole interval, every pool's."""
    value = host.get(key)
    if isinstance(value, bool) or not isinstance(value, (kind, int)):
        raise ValueError(f"{key} is {value!r:.40}, not a number")
    if not 0 <= value < COUNTER_LIMIT:  # NaN fails every comparison
        raise ValueError(f"{key} is {value!r:.40}, out of range")
    return kind(value)


@dataclass(frozen=True)
class HostLoad:
    """One host's part of one interval. Only `ok` hosts count toward the ratio: a host
    with no earlier sample, or a new boot, gives a baseline; an unanswered one (or one
    whose answer is not a host's usage) is unhealthy, which is not the same as idle."""

    host_id: str
    status: str  # ok, new, restarted, unanswered
    busy_s: float = 0.0
    capacity_s: float = 0.0  # Δ wall time x workers


class Tracker:
    """The last sample of every host, to turn absolute counters into deltas."""

    def __init__(self) -> None:
        self._last: dict[str, Sample] = {}

    def observe(self, host_id: str, sample: Sample | None) -> HostLoad:
        if sample is None:
            return HostLoad(host_id, "unanswered")  # keep its baseline: it may come back
        last, self._last[host_id] = self._last.get(host_id), sample
        if last is None:
            return HostLoad(host_id, "new")
        wall = sample.uptime_s - last.uptime_s
        busy = (sample.busy_ms - last.busy_ms) / 1000
        # Counters that went down, or more uptime than time passed: a new boot, whose
        # counters start from what it restored, not from our last sample.
        if wall <= 0 or busy < 0 or wall > sample.at - last.at + CLOCK_SLACK_S:
            return HostLoad(host_id, "restarted")
        return HostLoad(host_id, "ok", busy, wall * max(sample.workers, 1))

    def forget(self, keep: Iterable[str]) -> None:
        """Drop hosts no longer in the pool."""
        kept = set(keep)
        for host_id in [h for h in self._last if h not in kept]:
            del self._last[host_id]


def pool_ratio(loads: Iterable[HostLoad]) -> float | None:
    """The pool's busy ratio over the hosts that answered twice; None: no such host."""
    ok = [load for load in loads if load.status == "ok"]
    capacity = sum(load.capacity_s for load in ok)
    if not ok or capacity <= 0:
        return None
    return sum(load.busy_s for load in ok) / capacity
