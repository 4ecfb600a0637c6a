"""How many hosts a pool wants: ceil(current x ratio / target), bounded and stabilized."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    ratio: float | None  # None: no host answered twice, so no figure
    raw: int  # what this interval alone asks for, within the pool's bounds
    desired: int  # after the stabilization windows
    reason: str


class Decider:
    """One pool's decisions. Like Kubernetes' HPA stabilization: a scale-up happens when
    every recommendation over the up window asked for more (their minimum), a scale-down
    when every one over the down window asked for less (their maximum), and neither
    before the autoscaler has watched for that long. Bounds act at once, and so does
    demand for a pool at zero: its callers are waiting."""

    def __init__(
        self,
        pool: str,
        min_hosts: int,
        max_hosts: int,
        target: float,
        up_window_s: float,
        down_window_s: float,
    ) -> None:
        self.pool = pool
        self.min, self.max = min_hosts, max_hosts
        self.target = target
        self.up_window_s, self.down_window_s = up_window_s, down_window_s
        self._history: deque[tuple[float, int]] = deque()
        self._since: float | None = None  # first decision: the windows start filling

    def decide(self, now: float, current: int, ratio: float | None, demand: bool) -> Decision:
        if self._since is None:
            self._since = now
        if ratio is None:
            raw, why = current, "no figure"
        else:
            raw, why = math.ceil(current * ratio / self.target - 1e-9), "ratio"
        if demand and raw < 1:
            raw, why = 1, "demand"
        raw = min(max(raw, self.min), self.max)
        self._history.append((now, raw))
        horizon = now - max(self.up_window_s, self.down_window_s)
        while self._history and self._history[0][0] < horizon:
            self._history.popleft()

        if current < self.min or current > self.max:
            desired, reason = min(max(current, self.min), self.max), "bounds"
        elif current == 0 and demand:
            desired, reason = max(raw, 1), "demand at zero"
        elif raw > current and self._watched(now, self.up_window_s):
            desired = min(r for t, r in self._history if t >= now - self.up_window_s)
            reason = "scale up" if desired > current else "up window"
            desired = max(desired, current)
        elif raw < current and self._watched(now, self.down_window_s):
            desired = max(r for t, r in self._history if t >= now - self.down_window_s)
            reason = "scale down" if desired < current else "down window"
            desired = min(desired, current)
        else:
            desired, reason = current, "steady" if raw == current else "window filling"
        return Decision(self.pool, current, ratio, raw, desired, f"{reason} ({why})")

    def _watched(self, now: float, window_s: float) -> bool:
        assert self._since is not None
        return now - self._since >= window_s
