"""One thread does a server's torch work (runtime/engine_thread.py): ``run_server`` builds the real engine on the
``EngineThread`` that then runs its loop, and the app steps it there. Two threads that each start OpenMP work keep two
teams of workers, and on a machine with as many CPUs as one team has threads libgomp then stops the workers from
spinning between parallel regions (the workload 1.06-1.30x slower in process, benchmarks/RESULTS.md)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from pdserve.runtime import api_server
from pdserve.runtime import engine as engine_mod
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine_thread import EngineThread
from pdserve.runtime.routes import build_app
from pdserve.runtime.server_state import ServerOptions


def _config() -> EngineConfig:
    return EngineConfig.from_options(num_gpu_blocks=16, max_model_len=256, device="cpu")


@pytest.fixture
def threads_seen(monkeypatch) -> dict:
    """Records the thread that builds each LLMEngine and the threads that step it (the real engine, wrapped)."""
    seen: dict = {"built": [], "stepped": set()}
    init, step = engine_mod.LLMEngine.__init__, engine_mod.LLMEngine.step

    def recording_init(self, config):
        seen["built"].append(threading.get_ident())
        init(self, config)

    def recording_step(self):
        seen["stepped"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(engine_mod.LLMEngine, "step", recording_step)
    return seen


def test_run_server_builds_the_engine_on_the_thread_it_serves_with(threads_seen, monkeypatch):
    handed = {}

    def serve_engine(engine, options, *, kv_publisher=None, engine_thread=None):
        handed.update(engine=engine, thread=engine_thread)
        engine.shutdown()
        return 0

    monkeypatch.setattr(api_server, "serve_engine", serve_engine)
    assert api_server.run_server(_config(), ServerOptions()) == 0
    thread = handed["thread"]
    assert isinstance(thread, EngineThread)
    assert threads_seen["built"] == [thread.call(threading.get_ident)] != [threading.get_ident()]
    thread.close(5)


def test_the_app_steps_the_engine_on_the_thread_that_built_it(threads_seen):
    thread = EngineThread()
    engine = thread.call(engine_mod.LLMEngine, _config())
    try:
        with TestClient(build_app(engine, engine_thread=thread)) as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()
        thread.close(5)
    assert threads_seen["stepped"] == set(threads_seen["built"]) and len(threads_seen["built"]) == 1


def test_a_runtime_adapter_load_runs_on_the_engine_thread(threads_seen, monkeypatch, tmp_path):
    """Loading an adapter converts and checks its tensors with torch: on the server's CPU pool it gave OpenMP a second
    team (seen with gdb: a second libgomp worker after /v1/load_lora_adapter), so it runs on the engine thread."""
    from pdserve.runtime import lora_manager
    from tests.support.lora import ADAPTERS, make_adapter

    rank, alpha, targets, rslora = ADAPTERS["attn8"]
    adapter = make_adapter(tmp_path / "a", rank, alpha, targets, rslora, seed=1)
    loaded_on = []
    add = lora_manager.LoRAManager.add
    monkeypatch.setattr(lora_manager.LoRAManager, "add",
                        lambda self, *a, **k: loaded_on.append(threading.get_ident()) or add(self, *a, **k))
    monkeypatch.setenv("PDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    thread = EngineThread()
    engine = thread.call(engine_mod.LLMEngine, EngineConfig.from_options(
        num_gpu_blocks=16, max_model_len=256, device="cpu", enable_lora=True, max_lora_rank=8))
    try:
        with TestClient(build_app(engine, engine_thread=thread)) as c:
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)})
            assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()
        thread.close(5)
    assert loaded_on == list(threads_seen["built"]) and len(loaded_on) == 1


def test_engine_thread_runs_calls_in_order_and_hands_back_errors():
    thread = EngineThread()
    order: list[int] = []
    futures = [thread.submit(lambda i=i: order.append(i)) for i in range(5)]
    assert [f.result(5) for f in futures] == [None] * 5 and order == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    assert thread.call(threading.get_ident) != threading.get_ident()   # still alive after the error, on its thread
    thread.close(5)
    assert not thread._thread.is_alive()
