"""The server's options (``ServerOptions``, set by ``pdserve serve``'s flags) and the state its routes share
(``ServerState``: the engine seam, the ``AsyncEngine`` running it, metrics, drain flag, tokenizing pool)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.kv_connectors import kv_auth
from pdserve.runtime.async_engine import AsyncEngine
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.metrics import ServerMetrics

TOKENIZE_THREADS = 2


@dataclass(frozen=True)
class KVEventsOptions:
    """Where the KV event publisher binds (``--kv-events-*``); see runtime/kv_event_publisher.py."""

    port: int
    host: str = "127.0.0.1"
    replay_port: int | None = None
    topic: str = "kv-events"


@dataclass(frozen=True)
class ServerOptions:
    """Everything about serving that is not the engine's (the engine's is ``EngineConfig``)."""

    api_key: str | None = None
    max_waiting: int | None = None        # requests accepted but not started beyond this -> 503 + Retry-After
    role: str = "both"                    # reported on /health and in traces (the engine's KV role is in its config)
    host: str = "0.0.0.0"
    port: int = 8000
    shutdown_grace_period: float = 30.0   # seconds in-flight requests get after SIGTERM
    log_level: str = "info"
    kv_events: KVEventsOptions | None = None


class ServerState:
    """What every route of one app shares; ``app.state.pdserve``."""

    def __init__(self, engine: EngineClient, options: ServerOptions, metrics: ServerMetrics,
                 async_engine: AsyncEngine):
        self.engine, self.options, self.metrics, self.async_engine = engine, options, metrics, async_engine
        self.draining = False
        self.model_names = {engine.served_model_name, engine.config.model.model or ""} - {""}
        self.created = int(time.time())
        kvt = engine.config.kv_transfer   # the deployment's KV secret (None: no connector, or --kv-insecure)
        self.kv_handoff_secret = kv_auth.require_secret(kvt.connector, kvt.config) if kvt.connector else None
        # Tokenizing and chat-template rendering of a big prompt take seconds: off the event loop, so /health and
        # other requests keep being answered (a bounded pool: at most this many run at once).
        self.cpu_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)
