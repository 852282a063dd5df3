"""NIXL connector: decode READs prompt blocks straight out of the prefill pod's registered KV cache (UCX backend;
DRAM on CPU, VRAM on CUDA), the vLLM ``NixlConnector`` protocol with leases, authentication and verification added.

Prefill (role prefill/both) - ``request_finished`` of a request with ``do_remote_decode`` keeps its full prompt blocks
(delay_free) under a lease of ``lease_s`` seconds (:mod:`leases`) and answers vLLM-shaped ``kv_transfer_params`` plus
``lease_id``, ``fingerprint``, ``block_hashes`` and ``block_checksums`` (hex checksum of each block at handoff, in the
signed ``checksum_algo``: xxHash3 on CPU caches, the vectorized SUM64 on accelerators; see
:func:`block_codec.block_checksums`).
Checksums are computed off the engine thread as the engine reports blocks computed (``request_scheduled_for_save``: a
chunked prefill's earlier blocks are hashed while later chunks compute); the handoff hashes its last blocks on the
handoff thread (:mod:`handoff`), and the engine holds the response until the params (and the lease) are ready, or
``handoff_timeout_s`` passes: then the params list no blocks and the decode side computes the prompt itself.
An authenticated side channel (:mod:`side_channel`) on ``host:port`` serves ``meta`` (agent metadata, fingerprint,
cache address), ``heartbeat`` (extends a live lease) and ``done`` (releases the lease if it is alive and held exactly
the blocks and hashes the reader read). Blocks are freed (``get_finished`` sending) only when a lease is done or
expired.
The params are signed with the deployment's secret and expire with the lease (:mod:`kv_auth`).

Decode - the READ side: :mod:`nixl_reader`.

Config: ``host`` ("127.0.0.1"), ``port`` (0: any free port), ``advertise_host`` (host; this host's address when host
is 0.0.0.0), ``token`` (else PDSERVE_KV_TOKEN), ``lease_s`` (30), ``handshake_timeout_s`` (5), ``load_timeout_s``
(10), ``handoff_timeout_s`` (30), ``verify_checksums`` (true), ``chunk_blocks`` (16), ``max_inflight`` (4),
``backends`` (["UCX"]), ``engine_id``,
``progress_interval_s`` (0.001), ``progress_grace_s`` (10), ``max_side_channel_connections`` (32), ``ucx_net_devices``
(default: the interface of ``host``, so UCX listens only there; see :mod:`ucx_bind`), ``insecure`` (no secret: nothing
signed or checked).

CPU: NIXL's own progress thread spins a core, which starves the model's forward pass on small hosts, so agents run
without it: the decode side progresses its READs while polling them, and the prefill side runs a light progress loop
(``get_new_notifs`` every ``progress_interval_s``) only while it holds leases (and a grace period after), i.e. only
while a reader may come.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # the PyPI wheel for CUDA 12 installs the same API as nixl_cu12
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from pdserve.kv_connectors import block_codec, kv_auth, side_channel, ucx_bind
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec, register_connector
from pdserve.kv_connectors.block_codec import block_checksums, default_algo
from pdserve.kv_connectors.load_errors import logger
from pdserve.kv_connectors.leases import LeaseTable
from pdserve.kv_connectors.nixl_reader import NixlReader


@register_connector("nixl")
class NixlConnector(NixlReader):
    name = "nixl"

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        config = {"load_threads": 1, **config}   # one loader: agent calls and peer drops stay ordered
        super().__init__(role, config, spec)
        self.engine_id = str(config.get("engine_id") or f"pdserve-{uuid.uuid4().hex[:16]}")
        self.host = str(config.get("host", "127.0.0.1"))
        self.port = int(config.get("port", 0))
        self.advertise_host = str(config.get("advertise_host") or self.host)
        if self.advertise_host in ("0.0.0.0", "::", ""):   # bound to every interface: advertise this host's address
            self.advertise_host = socket.gethostbyname(socket.gethostname())
        self.token = self.secret or b""   # insecure mode (explicitly asked for): an empty key
        self.ucx_net_devices = config.get("ucx_net_devices")
        self.max_side_channel_connections = int(config.get("max_side_channel_connections", 32))
        self.leases = LeaseTable(float(config.get("lease_s", 30.0)))
        self.handshake_timeout_s = float(config.get("handshake_timeout_s", 5.0))
        self.verify_checksums = bool(config.get("verify_checksums", True))
        self.handoff_timeout_s = float(config.get("handoff_timeout_s", 30.0))
        self._hashing: dict[str, tuple[int, list[tuple[list[int], Future]]]] = {}   # rid -> (hashed upto, chunks)
        self.backends = list(config.get("backends", ["UCX"]))
        self.progress_interval_s = float(config.get("progress_interval_s", 0.001))
        self.progress_grace_s = float(config.get("progress_grace_s", 10.0))
        self.agent: Any = None
        self.server: side_channel.SideChannelServer | None = None
        self._closing = threading.Event()

    # ---- registration ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        super().register_kv_caches(kv_cache)
        assert kv_cache.is_contiguous(), "NIXL registers the cache as one region"
        self.checksum_algo = default_algo(kv_cache.device)
        with ucx_bind.bound_to(self.ucx_net_devices or ucx_bind.net_devices(self.host)):
            self.agent = nixl_agent(self.engine_id, nixl_agent_config(
                backends=self.backends, enable_prog_thread=False, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self._reg = self.agent.register_memory(kv_cache)
        self.mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.device_id = kv_cache.device.index or 0
        self.block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        self._local_descs = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._block_descs(
            kv_cache.data_ptr(), kv_cache.shape[0], self.device_id), self.mem_type)
        if self.role in ("prefill", "both"):
            self.server = side_channel.SideChannelServer(
                self.host, self.port, self.token, self._handle, timeout=self.handshake_timeout_s,
                on_auth_failure=lambda: self.stats.add("kv_side_channel_auth_failures"),
                engine_id=self.engine_id, advertise_host=self.advertise_host,
                max_connections=self.max_side_channel_connections,
                on_busy=lambda: self.stats.add("kv_side_channel_busy_rejections"))
            self.port = self.server.port
            threading.Thread(target=self._progress_loop, name="pdserve-nixl-progress", daemon=True).start()
            logger.info("nixl: engine %s serves KV on %s:%d", self.engine_id, self.host, self.port)

    def _progress_loop(self) -> None:
        # The READ target must progress its UCX worker (connection wire-up, active messages on TCP).
        # It keeps going for ``progress_grace_s`` after the last lease, so a late reader gets its answer
        # (lease_expired) at once instead of a READ timeout.
        idle_since: float | None = None
        while not self._closing.is_set():
            now = time.monotonic()
            if len(self.leases):
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since > self.progress_grace_s:
                self.leases.wait_active(0.5)
                continue
            self.agent.get_new_notifs()
            time.sleep(self.progress_interval_s)

    def _block_descs(self, base: int, num_blocks: int, device_id: int) -> list[tuple[int, int, int]]:
        return [(base + i * self.block_nbytes, self.block_nbytes, device_id) for i in range(num_blocks)]

    # ---- prefill side ----------------------------------------------------------------------------------------------
    def _handle(self, op: str, body: dict) -> dict:
        if op == "meta":
            return {"engine_id": self.engine_id, "agent_metadata": self.agent.get_agent_metadata(),
                    "fingerprint": self.fingerprint, "base_addr": self.kv_cache.data_ptr(),
                    "block_bytes": self.block_nbytes, "num_blocks": self.kv_cache.shape[0],
                    "device_id": self.device_id, "mem_type": self.mem_type}
        if op == "heartbeat":
            return {"alive": self.leases.heartbeat(str(body.get("lease_id")))}
        if op == "done":
            verdict = self.leases.done(str(body.get("lease_id")), list(body.get("blocks") or []))
            return {"valid": verdict == "valid", "verdict": verdict}
        raise ValueError(f"unknown op {op!r}")

    def request_scheduled_for_save(self, request: ConnectorRequest, block_ids: list[int],
                                   num_computed_tokens: int) -> None:
        """Hash the prompt blocks a handoff request completed this step, off the engine thread (their KV is final)."""
        if self.server is None or not self.verify_checksums or not (request.kv_transfer_params or {}).get(
                "do_remote_decode"):
            return
        n = min(num_computed_tokens // self.spec.block_size, len(request.block_hashes), len(block_ids))
        upto, chunks = self._hashing.get(request.request_id, (0, []))
        if n < upto:   # cut back (a load error upstream): what was hashed may be recomputed differently
            upto, chunks = 0, []
        if n > upto:
            ids = list(block_ids[upto:n])
            fut = block_codec.hash_pool().submit(block_checksums, self.kv_cache, ids, self.checksum_algo)
            chunks.append((ids, fut))
        self._hashing[request.request_id] = (max(n, upto), chunks)

    def _handoff_checksums(self, chunks: list[tuple[list[int], Future]], ids: list[int]) -> list[int]:
        """Checksums of blocks ``ids`` (on the handoff thread): those hashed in the background as they completed, the
        rest now."""
        out: list[int] = []
        deadline = time.monotonic() + self.handshake_timeout_s
        for chunk_ids, fut in chunks:
            if ids[len(out):len(out) + len(chunk_ids)] != chunk_ids:
                break
            try:   # a stalled hashing pool: hash the rest here instead
                out += fut.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                break
        return out + block_checksums(self.kv_cache, ids[len(out):], self.checksum_algo)

    def _on_request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None, bool]:
        rid, params = request.request_id, request.kv_transfer_params or {}
        _, chunks = self._hashing.pop(rid, (0, []))
        if not params.get("do_remote_decode") or self.server is None:
            return False, None, False
        n = min(len(request.block_hashes), len(block_ids))
        ids = list(block_ids[:n])
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
               "remote_block_ids": ids, "remote_request_id": rid,
               "remote_host": self.advertise_host, "remote_port": self.port, "tp_size": 1, "connector": self.name,
               "fingerprint": self.fingerprint, "block_hashes": [h.hex() for h in request.block_hashes[:n]],
               **kv_auth.lora_identity(request)}
        if not ids:
            return False, kv_auth.sign_params(out, self.secret, self.leases.lease_s), False

        def publish(sums: list[int] | None) -> dict:   # the lease starts only once the params are valid
            if sums is not None:   # hex strings: JSON routers copy these params, and may not keep 64-bit ints exact
                out["checksum_algo"] = self.checksum_algo
                out["block_checksums"] = [f"{c:x}" for c in sums]
            out["lease_id"] = self.leases.grant(rid, ids, out["block_hashes"])
            out["lease_ms"] = int(self.leases.lease_s * 1000)
            return kv_auth.sign_params(out, self.secret, self.leases.lease_s)

        if not self.verify_checksums:
            return True, publish(None), False

        def fallback() -> dict:   # no lease, nothing to read: the decode side computes the prompt itself
            logger.warning("nixl: handoff of %s not ready within %.1fs: the decode side recomputes it", rid,
                           self.handoff_timeout_s)
            self.stats.add("kv_handoffs_failed")
            return kv_auth.sign_params({**out, "remote_block_ids": [], "block_hashes": []}, self.secret,
                                       self.leases.lease_s)

        # The checksums run on the handoff thread; the blocks stay held (delay_free) until the lease (published) or
        # the work (fallback) lets them go.
        self.handoffs.start(rid, self.handoff_timeout_s, lambda: self._handoff_checksums(chunks, ids), publish,
                            fallback, lambda published: None if published else self._freed(rid))
        return True, None, True

    def _finished_sending(self) -> set[str]:
        freed = self.leases.reap()
        self.stats.add("kv_leases_released", len(freed))
        return freed

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "kv_leases_active": len(self.leases), "kv_leases_expired": self.leases.num_expired}

    def shutdown(self) -> None:
        super().shutdown()
        self._closing.set()
        if self.server:
            self.server.close()
            self.server = None
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
