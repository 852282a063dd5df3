"""End to end: `pdserve up` (router + prefill + decode on the default model) driven with the official openai client.

Checks the answers equal a monolithic engine's, that killing the decode process gives in-flight requests a clean error
and that `up` restarts it so new requests are served again, and that stopping `up` leaves no process or port behind.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from openai import APIError, OpenAI

from tests.support.server import free_port, launch_process

pytestmark = pytest.mark.slow

PROMPTS = ["Name the largest planet in the solar system.", "Write one sentence about rivers."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def monolithic_answers() -> dict[str, tuple[str, str]]:
    """(text, finish_reason) of a monolithic engine per prompt: greedy, so `up` must give both exactly."""
    from pdserve.runtime import LLM, SamplingParams

    llm = LLM(dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chats = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    completion = llm.generate(["The three primary colors are"], params)
    answers = {p: (o.outputs[0].text, o.outputs[0].finish_reason) for p, o in zip(PROMPTS, chats)}
    answers["completion"] = (completion[0].outputs[0].text, completion[0].outputs[0].finish_reason)
    llm.shutdown()
    assert all(reason in ("stop", "length") for _, reason in answers.values())
    return answers


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _port_free(port: int) -> bool:
    """Nothing listens there any more (TIME_WAIT leftovers are fine: servers bind with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_up_serves_recovers_and_stops_cleanly(monolithic_answers):
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--dtype", "float32", "--startup-timeout", "600"]
    with launch_process(cmd, port, timeout=900, stop_timeout=60) as up:
        client = OpenAI(base_url=f"{up.url}/v1", api_key="unused", timeout=120, max_retries=0)
        model = client.models.list().data[0].id

        # Chat, streaming chat and completions all equal the monolithic engine's greedy output.
        for prompt in PROMPTS:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=MAX_TOKENS, temperature=0)
            assert (r.choices[0].message.content, r.choices[0].finish_reason) == monolithic_answers[prompt]
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                     max_tokens=MAX_TOKENS, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == monolithic_answers[PROMPTS[0]][0]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            monolithic_answers[PROMPTS[0]][1]]                      # one finish, on the last choice chunk, the same
        r = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=MAX_TOKENS,
                                      temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == monolithic_answers["completion"]

        # Kill decode while a long stream is in flight: the client gets an error, never a hang, and never anything
        # that reads as a normal end. ignore_eos: the request's one correct finish is "length" after 400 tokens, so
        # any finish_reason ("stop", "length", "abort", ...) or a usage chunk after the kill is a fabricated end.
        decode = next(p for p in _children(up.proc) if "--role" in p.cmdline() and "decode" in p.cmdline())
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 500."}],
                                                max_tokens=400, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        decode.send_signal(signal.SIGKILL)
        error = None
        try:
            for c in stream:
                chunks.append(c)
        except (APIError, httpx.HTTPError) as e:
            error = e
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [] and all(c.usage is None for c in chunks), (
            f"a stream whose decode pod was killed ended like a completed one: {finishes}, {chunks[-1]}")
        assert error is not None, "the cut stream ended without an error event: the client cannot tell it was cut"

        # `up` restarts decode; new requests are served again (bounded wait).
        deadline, answer = time.monotonic() + 600, None
        while time.monotonic() < deadline and answer is None:
            try:
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                   max_tokens=MAX_TOKENS, temperature=0, timeout=60)
                answer = r.choices[0].message.content
            except (APIError, httpx.HTTPError):
                time.sleep(2)
        assert (answer, r.choices[0].finish_reason) == monolithic_answers[PROMPTS[1]]

        children = _children(up.proc)
        ports = [port] + [int(p.cmdline()[p.cmdline().index("--port") + 1]) for p in children
                          if "--port" in p.cmdline()]
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=90) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphans left: {[p.cmdline() for p in alive]}"
    assert all(_port_free(p) for p in ports)
