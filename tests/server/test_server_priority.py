"""The request's `priority` reaches the scheduler over HTTP: with `--scheduling-policy priority` and one running slot,
a later request with a lower priority value is served before an earlier one with a higher value (vLLM's convention)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve.runtime.metrics import parse_samples
from tests.support.server import launch_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WAITING = f'vllm:num_requests_waiting{{model_name="{MODEL}"}}'


@pytest.fixture(scope="module")
def server():
    with launch_server("--scheduling-policy", "priority", "--max-num-seqs", "1", "--num-gpu-blocks", "64",
                       "--max-model-len", "512") as handle:
        yield handle


def wait_waiting(server, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while parse_samples(httpx.get(server.url + "/metrics", timeout=10).text)[WAITING] != n:
        assert time.monotonic() < deadline, f"never {n} waiting"
        time.sleep(0.05)


def test_lower_priority_value_is_served_first(server):
    done: list[str] = []
    lock = threading.Lock()

    def post(name: str, priority: int) -> None:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": f"Request {name}:", "max_tokens": 2, "ignore_eos": True, "priority": priority})
        assert r.status_code == 200, r.text
        with lock:
            done.append(name)

    # A holds the only running slot; B (priority 5) queues first, C (priority -5) after it.
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}) as a:
        lines = a.iter_lines()    # kept: a dropped iterator closes the stream, and the server aborts A at once
        next(lines)
        threads = {name: threading.Thread(target=post, args=(name, prio)) for name, prio in (("B", 5), ("C", -5))}
        threads["B"].start()
        wait_waiting(server, 1)
        threads["C"].start()
        wait_waiting(server, 2)
    # closing A's stream aborts it and frees the slot: FCFS (priority dropped on the way) would now run B first
    for t in threads.values():
        t.join(timeout=120)
    assert done == ["C", "B"]
