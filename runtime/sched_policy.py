"""The scheduler's choices of *who*: which waiting request is admitted next, which running one is preempted when the
pool runs dry, and whether a request's LoRA adapter fits the device slots. ``fcfs`` serves in arrival order and
preempts the latest admitted; ``priority`` serves the lowest (priority, arrival) first and preempts the highest."""

from __future__ import annotations

from collections import deque

from pdserve.runtime.request import Request


def pop_waiting(waiting: deque[Request], policy: str) -> Request:
    """Remove and return the next request to admit."""
    if policy == "priority":
        best = min(waiting, key=lambda r: (r.priority, r.arrival_time))
        waiting.remove(best)
        return best
    return waiting.popleft()


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request to preempt."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


def lora_fits(req: Request, running: list[Request], max_loras: int | None) -> bool:
    """Running requests use at most ``max_loras`` distinct adapters, so every step's adapters fit the slots."""
    if max_loras is None or req.lora is None:
        return True
    active = {r.lora.int_id for r in running if r.lora is not None}
    return req.lora.int_id in active or len(active) < max_loras
