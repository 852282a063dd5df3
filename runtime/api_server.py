"""The server process: ``run_server(config, options)`` builds the engine (and the KV event publisher) and serves the
app (runtime/routes.py) with uvicorn until SIGTERM/SIGINT; the first signal drains (runtime/drain.py), a second one
exits at once. ``pdserve serve`` (runtime/cli.py) turns flags into the two arguments."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.drain import drain
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.engine_thread import EngineThread
from pdserve.runtime.kv_event_publisher import KVEventPublisher
from pdserve.runtime.routes import build_app
from pdserve.runtime.server_state import ServerOptions

logger = logging.getLogger(__name__)


class _GracefulServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see ``drain``) before exiting 0; a second one exits now."""

    def __init__(self, app: FastAPI, config: Any, grace_period_s: float):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # runs in the main thread between bytecodes
                if outer.draining:
                    self.should_exit = self.force_exit = True
                    return
                outer.draining = True
                logger.info("signal %d: draining for up to %.0fs", sig, grace_period_s)
                outer.loop.call_soon_threadsafe(outer.start_drain)

        self.app, self.grace_period_s, self.draining = app, grace_period_s, False
        self.server = Server(config)
        self.loop: Any = None   # the serving event loop, set by ``serve`` before any signal can be handled

    def start_drain(self) -> None:
        task = asyncio.ensure_future(drain(self.app.state.pdserve, self.grace_period_s))
        task.add_done_callback(lambda _: setattr(self.server, "should_exit", True))

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """``pdserve serve``: build the engine from ``config`` and serve it as ``options`` say until signalled."""
    from pdserve.runtime.engine import LLMEngine

    thread = EngineThread()   # builds the engine and then steps it: one thread does all of its torch work
    engine = thread.call(LLMEngine, config)
    publisher = None
    ev = options.kv_events
    if ev is not None:
        publisher = KVEventPublisher(ev.host, ev.port, replay_port=ev.replay_port, topic=ev.topic)
    return serve_engine(engine, options, kv_publisher=publisher, engine_thread=thread)


def serve_engine(engine: EngineClient, options: ServerOptions, *, kv_publisher: KVEventPublisher | None = None,
                 engine_thread: EngineThread | None = None) -> int:
    """Serve ``engine`` until SIGTERM/SIGINT, then drain and return 0. Owns and shuts down the engine and publisher;
    ``engine_thread``: the thread that built the engine, which then runs its loop."""
    import uvicorn

    app = build_app(engine, options, kv_publisher=kv_publisher, engine_thread=engine_thread)
    uv_config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level.lower(),
                               access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = _GracefulServer(app, uv_config, options.shutdown_grace_period)
    try:
        asyncio.run(server.serve())
    finally:
        if kv_publisher is not None:
            kv_publisher.close()
        engine.shutdown()
    return 0 if server.server.started or server.draining else 1
