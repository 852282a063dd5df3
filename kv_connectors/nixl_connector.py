"""NIXL connector: decode READs prompt blocks straight out of the prefill pod's registered KV cache (UCX backend;
DRAM on CPU, VRAM on CUDA), the vLLM ``NixlConnector`` protocol with leases, authentication and verification added.

Prefill (role prefill/both) - ``request_finished`` of a request with ``do_remote_decode`` keeps its full prompt blocks
(delay_free) under a lease of ``lease_s`` seconds (:mod:`leases`) and answers vLLM-shaped ``kv_transfer_params`` plus
``lease_id``, ``fingerprint``, ``block_hashes`` and ``block_checksums`` (xxHash3/CRC-32 hex of each block at handoff).
An authenticated side channel (:mod:`side_channel`) on ``host:port`` serves ``meta`` (agent metadata, fingerprint,
cache address), ``heartbeat`` (extends a live lease) and ``done`` (releases the lease if it is alive and held exactly
the blocks and hashes the reader read). Blocks are freed (``get_finished`` sending) only when a lease is done or expired.
The params are signed with the deployment's secret and expire with the lease (:mod:`kv_auth`).

Decode - a request with ``do_remote_prefill`` params whose signature checks out (anything else is ignored before any
connection: no client can make a decode pod dial an address it names) and a lease claims the listed blocks that match
its own prompt beyond its local prefix hits and loads them in a background thread: handshake (mutually authenticated,
bound to the peer's engine id and address, so no relay; cached per peer; a peer whose call fails is dropped and
re-handshaken next time), fingerprint check before any transfer, one NIXL READ with a deadline (heartbeats keep the
lease alive while a long one runs), then ``done``: only a lease still valid after the read proves the prefill
blocks were never freed and reused during it, so an expired lease fails the load (``lease_expired``) instead of
returning wrong tokens, and params edited to point elsewhere fail it (``corrupt``). Finally each block's checksum is
re-checked (``verify_checksums``, default on for CPU caches).

Config: ``host`` ("127.0.0.1"), ``port`` (0: any free port), ``advertise_host`` (host; this host's address when host
is 0.0.0.0), ``token`` (else PDSERVE_KV_TOKEN), ``lease_s`` (30), ``handshake_timeout_s`` (5), ``load_timeout_s``
(10), ``verify_checksums``, ``backends`` (["UCX"]), ``engine_id``, ``progress_interval_s`` (0.001),
``progress_grace_s`` (10), ``max_side_channel_connections`` (32), ``ucx_net_devices`` (default: the interface of
``host``, so UCX listens only there; see :mod:`ucx_bind`), ``insecure`` (no secret: nothing signed or checked).

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
from dataclasses import dataclass
from typing import Any

import torch

try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # the PyPI wheel for CUDA 12 installs the same API as nixl_cu12
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from pdserve.kv_connectors import kv_auth, side_channel, ucx_bind
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec, register_connector
from pdserve.kv_connectors.block_codec import ALGO_CRC32, checksum, default_algo, tensor_bytes
from pdserve.kv_connectors.load_errors import (CorruptBlock, FingerprintMismatch, KVLoadError, LeaseExpired,
                                               LoadTimeout, PeerUnreachable, logger)
from pdserve.kv_connectors.leases import LeaseTable
from pdserve.kv_connectors.loading import LoadingConnector, LoadJob


@dataclass
class Peer:
    host: str
    port: int
    engine_id: str
    agent_name: str
    descs: Any   # prepped remote descriptor list, one descriptor per remote block
    num_blocks: int


@register_connector("nixl")
class NixlConnector(LoadingConnector):
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
        self.verify_checksums = config.get("verify_checksums")
        self.backends = list(config.get("backends", ["UCX"]))
        self.progress_interval_s = float(config.get("progress_interval_s", 0.001))
        self.progress_grace_s = float(config.get("progress_grace_s", 10.0))
        self.agent: Any = None
        self.server: side_channel.SideChannelServer | None = None
        self._closing = threading.Event()
        self._peers: dict[tuple[str, int], Peer] = {}

    # ---- registration ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        super().register_kv_caches(kv_cache)
        assert kv_cache.is_contiguous(), "NIXL registers the cache as one region"
        if self.verify_checksums is None:
            self.verify_checksums = kv_cache.device.type == "cpu"
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

    def _on_request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or self.server is None:
            return False, None
        n = min(len(request.block_hashes), len(block_ids))
        ids = list(block_ids[:n])
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
               "remote_block_ids": ids, "remote_request_id": request.request_id,
               "remote_host": self.advertise_host, "remote_port": self.port, "tp_size": 1, "connector": self.name,
               "fingerprint": self.fingerprint, "block_hashes": [h.hex() for h in request.block_hashes[:n]]}
        if not ids:
            return False, kv_auth.sign_params(out, self.secret, self.leases.lease_s)
        if self.verify_checksums:
            algo = default_algo()   # hex strings: JSON routers copy these params, and may not keep 64-bit ints exact
            out["checksum_algo"] = algo
            out["block_checksums"] = [f"{checksum(tensor_bytes(self.kv_cache[b].cpu()), algo):x}" for b in ids]
        out["lease_id"] = self.leases.grant(request.request_id, ids, out["block_hashes"])
        out["lease_ms"] = int(self.leases.lease_s * 1000)
        return True, kv_auth.sign_params(out, self.secret, self.leases.lease_s)

    def _finished_sending(self) -> set[str]:
        freed = self.leases.reap()
        self.stats.add("kv_leases_released", len(freed))
        return freed

    # ---- decode side -----------------------------------------------------------------------------------------------
    def _num_loadable(self, request: ConnectorRequest, start: int, hashes: list[bytes],
                      params: dict[str, Any] | None) -> int:
        p = params or {}
        if not (p.get("do_remote_prefill") and p.get("remote_host") and p.get("remote_port") and p.get("lease_id")):
            return 0   # without a lease nothing proves what the remote blocks hold
        remote = p.get("block_hashes") or []
        limit = min(len(hashes), len(remote), len(p.get("remote_block_ids") or []))
        n = 0
        while start + n < limit and remote[start + n] == hashes[start + n].hex():
            n += 1
        return n

    def _call(self, peer: Peer, op: str, body: dict) -> dict:
        try:
            return side_channel.call(peer.host, peer.port, self.token, op, body, self.handshake_timeout_s,
                                     client_id=self.engine_id, server_engine_id=peer.engine_id)
        except KVLoadError:
            self._drop_peer(peer)
            raise

    def _peer(self, host: str, port: int, engine_id: str | None) -> Peer:
        peer = self._peers.get((host, port))
        if peer and (engine_id is None or peer.engine_id == engine_id):
            return peer
        if peer:                      # another engine answers there now: the old one is gone
            self._drop_peer(peer)
        meta = side_channel.call(host, port, self.token, "meta", {}, self.handshake_timeout_s,
                                 client_id=self.engine_id, server_engine_id=engine_id)
        if meta["fingerprint"] != self.fingerprint:
            raise FingerprintMismatch(f"peer {host}:{port} has fingerprint {meta['fingerprint']}, ours is "
                                      f"{self.fingerprint}")
        if engine_id is not None and meta["engine_id"] != engine_id:
            raise PeerUnreachable(f"engine {engine_id} is gone ({host}:{port} is now {meta['engine_id']})")
        name = self.agent.add_remote_agent(meta["agent_metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        descs = self.agent.prep_xfer_dlist(name, [(meta["base_addr"] + i * meta["block_bytes"], meta["block_bytes"],
                                                   meta["device_id"]) for i in range(meta["num_blocks"])],
                                           meta["mem_type"])
        peer = Peer(host, port, meta["engine_id"], name, descs, int(meta["num_blocks"]))
        self._peers[(host, port)] = peer
        self.stats.add("kv_peer_handshakes")
        return peer

    def _drop_peer(self, peer: Peer) -> None:
        if self._peers.get((peer.host, peer.port)) is not peer:
            return
        del self._peers[(peer.host, peer.port)]
        self.stats.add("kv_peers_dropped")
        try:
            peer.descs.release()
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as e:  # the agent may already consider it gone
            logger.debug("nixl: dropping peer %s: %r", peer.agent_name, e)

    def _load(self, job: LoadJob) -> dict[int, KVLoadError]:
        p = job.params or {}
        if p.get("fingerprint") != self.fingerprint:
            raise FingerprintMismatch(f"prefill fingerprint {p.get('fingerprint')} != ours {self.fingerprint}")
        peer = self._peer(str(p["remote_host"]), int(p["remote_port"]), p.get("remote_engine_id"))
        lease_id = p.get("lease_id")   # no heartbeat first: "done" after the read decides, and costs one round trip
        local = [b for _, b, _ in job.blocks]
        remote = [int(p["remote_block_ids"][i]) for i, _, _ in job.blocks]
        if any(not 0 <= r < peer.num_blocks for r in remote):
            raise CorruptBlock(f"remote block ids out of range for {peer.agent_name}")
        self._read(job, peer, local, remote, lease_id)
        read = [[i, r, h.hex()] for (i, _, h), r in zip(job.blocks, remote)]
        verdict = self._call(peer, "done", {"lease_id": lease_id, "blocks": read}).get("verdict")
        if verdict == "mismatch":
            raise CorruptBlock(f"prefill says the params of {p.get('remote_request_id')} do not match its lease")
        if verdict != "valid":
            raise LeaseExpired(f"lease of {p.get('remote_request_id')} expired before the read completed")
        errors: dict[int, KVLoadError] = {}
        sums = p.get("block_checksums") if self.verify_checksums else None
        algo = int(p.get("checksum_algo", ALGO_CRC32))
        for i, b, _ in job.blocks if sums else ():
            if f"{checksum(tensor_bytes(self.kv_cache[b].cpu()), algo):x}" != sums[i]:
                errors[b] = CorruptBlock(f"block {i} checksum differs from the prefill's at handoff")
        return errors

    def _read(self, job: LoadJob, peer: Peer, local: list[int], remote: list[int], lease_id: str | None) -> None:
        with self._lock:
            if job.cancelled:
                raise LoadTimeout("load cancelled after its deadline")
        handle = None
        try:
            handle = self.agent.make_prepped_xfer("READ", self._local_descs, local, peer.descs, remote)
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.load_timeout_s
            next_beat = time.monotonic() + self.leases.lease_s / 3
            while state == "PROC":
                now = time.monotonic()
                if job.cancelled:
                    raise LoadTimeout("load cancelled by the watchdog")
                if now > deadline:
                    raise LoadTimeout(f"NIXL READ of {len(local)} blocks not done within {self.load_timeout_s}s")
                if lease_id and now > next_beat:   # a long transfer keeps its lease alive
                    self._call(peer, "heartbeat", {"lease_id": lease_id})
                    next_beat = now + self.leases.lease_s / 3
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerUnreachable(f"NIXL READ from {peer.agent_name} failed ({state})")
        except KVLoadError:
            self._drop_peer(peer)
            raise
        except Exception as e:   # NIXL raises e.g. nixlRemoteDisconnectError for a peer that died
            self._drop_peer(peer)
            raise PeerUnreachable(f"NIXL READ from {peer.agent_name} failed: {e!r}") from e
        finally:
            try:
                if handle is not None:
                    handle.release()   # aborts a transfer still in flight
            except Exception as e:
                logger.warning("nixl: releasing a transfer handle failed: %r", e)

    def _watchdog_s(self) -> float:
        # handshake + READ (heartbeats during it are bounded by the READ deadline's loop) + done, with slack
        return self.load_timeout_s + 3 * self.handshake_timeout_s + 5.0

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
