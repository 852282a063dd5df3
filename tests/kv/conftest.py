"""Drive connectors through the base contract exactly as the engine does, on a small plain KV tensor (no model)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from pdserve.kv_connectors.base import KVCacheSpec, KVConnectorBase, PromptRequest

BLOCK = 4
SPEC = KVCacheSpec(model="tiny-test", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK)


# The fields of an engine request a connector may read (ConnectorRequest), with this module's block size.
Req = partial(PromptRequest, block_size=BLOCK)


def resign(params: dict, secret: str | bytes | None = None, ttl_s: float = 60.0) -> dict:
    """``params`` (edited by a test to stage a fault) signed again with the deployment's secret, as a real prefill with
    those properties would have signed them: the fault then reaches the load path instead of the signature check."""
    from pdserve.kv_connectors import kv_auth

    secret = secret if secret is not None else os.environ["PDSERVE_KV_TOKEN"]
    body = {k: v for k, v in params.items() if k not in (kv_auth.SIGNATURE_FIELD, kv_auth.EXPIRES_FIELD)}
    return kv_auth.sign_params(body, secret.encode() if isinstance(secret, str) else secret, ttl_s)


def make_cache(num_blocks: int = 32, spec: KVCacheSpec = SPEC, fill: bool = False) -> torch.Tensor:
    shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    return torch.randn(shape).to(dtype) if fill else torch.zeros(shape, dtype=dtype)


def prefill(conn: KVConnectorBase, req: Req, block_ids: list[int]) -> dict | None:
    """The engine's view of a request that computed its whole prompt and finished."""
    conn.request_scheduled_for_save(req, block_ids, len(req.prompt_token_ids))
    delay, params = conn.request_finished(req, block_ids)
    return params


@dataclass
class LoadResult:
    num_tokens: int
    is_async: bool
    bad_blocks: set[int]
    seconds: float


def load(conn: KVConnectorBase, req: Req, block_ids: list[int], num_local_tokens: int = 0,
         timeout: float = 60.0) -> LoadResult:
    """schedule -> alloc -> meta -> start_load_kv -> poll get_finished (async) -> load errors, as the engine does."""
    t0 = time.monotonic()
    n, is_async = conn.get_num_new_matched_tokens(req, num_local_tokens)
    conn.update_state_after_alloc(req, block_ids, n)
    meta = conn.build_connector_meta()
    conn.start_load_kv(meta)
    bad: set[int] = set()
    if n and is_async:
        while True:
            _, recving = conn.get_finished()
            bad |= conn.get_block_ids_with_load_errors()
            if req.request_id in recving:
                break
            assert time.monotonic() - t0 < timeout, "load never reported finished"
            time.sleep(0.01)
    bad |= conn.get_block_ids_with_load_errors()
    return LoadResult(n, is_async, bad, time.monotonic() - t0)


def slow_record(path, data: bytes, first: int) -> tuple[threading.Event, threading.Event]:
    """Replace the disk record at ``path`` by a FIFO fed by a thread: ``data[:first]`` as soon as a reader opens it,
    the rest once the returned ``go`` event is set (then ``done`` is set). A read of it blocks mid-record in the kernel,
    as on a hung network disk: a real slow file, not a stand-in for the connector's code."""
    path.unlink()
    os.mkfifo(path)
    go, done = threading.Event(), threading.Event()

    def feed():
        with open(path, "wb", buffering=0) as f:   # blocks until the loader opens the record
            f.write(data[:first])
            go.wait(60)
            f.write(data[first:])
        done.set()

    threading.Thread(target=feed, daemon=True).start()
    return go, done


@pytest.fixture
def spec() -> KVCacheSpec:
    return SPEC
