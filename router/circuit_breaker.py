"""Per-pod circuit breaker: closed -> open after N consecutive failures -> half-open after a cool-down -> closed.

Half-open admits one probe request at a time; its success closes the breaker, its failure re-opens it. Failures are
upstream connect errors, timeouts and 5xx answers (not client errors, which say nothing about the pod).
"""

from __future__ import annotations

import time
from typing import Callable, Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    __slots__ = ("threshold", "open_seconds", "clock", "failures", "opened_at", "probing")

    def __init__(self, threshold: int = 5, open_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.open_seconds = open_seconds
        self.clock = clock
        self.failures = 0                  # consecutive
        self.opened_at: float | None = None
        self.probing = False               # a half-open probe is in flight

    @property
    def state(self) -> State:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.open_seconds else "open"

    def can_route(self) -> bool:
        """May a request go to this pod now? (Half-open: only while no probe is in flight.)"""
        if self.opened_at is None:
            return True
        return self.state == "half_open" and not self.probing

    def on_dispatch(self) -> None:
        if self.opened_at is not None and self.state == "half_open":
            self.probing = True

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.probing = False

    def record_failure(self) -> None:
        self.failures += 1
        self.probing = False
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = self.clock()  # (re)open: a failed probe restarts the cool-down
