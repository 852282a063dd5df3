"""NIXL connector: decode READs prompt blocks straight out of the prefill pod's registered KV cache (UCX backend;
DRAM on CPU, VRAM on CUDA), the vLLM ``NixlConnector`` protocol with leases, authentication and verification added.

Prefill (role prefill/both) - ``request_finished`` of a request with ``do_remote_decode`` keeps its full prompt blocks
(delay_free) under a lease of ``lease_s`` seconds (:mod:`leases`) and answers vLLM-shaped ``kv_transfer_params`` plus
``lease_id``, ``fingerprint``, ``block_hashes`` and ``block_checksums`` (hex checksum of each block at handoff, in the
signed ``checksum_algo``: xxHash3 on CPU caches, the vectorized SUM64 on accelerators; see
:func:`block_codec.block_checksums`).
Checksums are computed off the engine thread as the engine reports blocks computed (``request_scheduled_for_save``: a
chunked prefill's earlier blocks are hashed while later chunks compute), so the handoff only hashes its last blocks.
An authenticated side channel (:mod:`side_channel`) on ``host:port`` serves ``meta`` (agent metadata, fingerprint,
cache address), ``heartbeat`` (extends a live lease) and ``done`` (releases the lease if it is alive and held exactly
the blocks and hashes the reader read). Blocks are freed (``get_finished`` sending) only when a lease is done or
expired.
The params are signed with the deployment's secret and expire with the lease (:mod:`kv_auth`).

Decode - a request with ``do_remote_prefill`` params whose signature checks out (anything else is ignored before any
connection: no client can make a decode pod dial an address it names) and a lease claims the listed blocks that match
its own prompt beyond its local prefix hits and loads them in a background thread: handshake (mutually authenticated,
bound to the peer's engine id and address, so no relay; cached per peer; a peer whose call fails is dropped and
re-handshaken next time), fingerprint check before any transfer, the READ in chunks of ``chunk_blocks`` blocks
with up to ``max_inflight`` in flight under one deadline (heartbeats keep the lease alive while a long one runs), each
chunk's checksums verified by the hash threads as soon as it lands while later chunks still move, then ``done``: only
a lease still valid after the read proves the prefill blocks were never freed and reused during it, so an expired
lease fails the load (``lease_expired``) instead of returning wrong tokens, and params edited to point elsewhere fail
it (``corrupt``). A block whose checksum differs is reported bad (the engine cuts the request's prefix back to its
first bad block and recomputes from there); a READ that fails (peer gone) fails the whole load. ``verify_checksums``:
default on.

Config: ``host`` ("127.0.0.1"), ``port`` (0: any free port), ``advertise_host`` (host; this host's address when host
is 0.0.0.0), ``token`` (else PDSERVE_KV_TOKEN), ``lease_s`` (30), ``handshake_timeout_s`` (5), ``load_timeout_s``
(10), ``verify_checksums`` (true), ``chunk_blocks`` (16), ``max_inflight`` (4), ``backends`` (["UCX"]), ``engine_id``,
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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # the PyPI wheel for CUDA 12 installs the same API as nixl_cu12
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from pdserve.kv_connectors import block_codec, kv_auth, side_channel, ucx_bind
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec, register_connector
from pdserve.kv_connectors.block_codec import ALGO_CRC32, ALGOS, block_checksums, default_algo
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
        self.verify_checksums = bool(config.get("verify_checksums", True))
        self.chunk_blocks = max(1, int(config.get("chunk_blocks", 16)))
        self.max_inflight = max(1, int(config.get("max_inflight", 4)))
        self._hashing: dict[str, tuple[int, list[tuple[list[int], Future]]]] = {}   # rid -> (hashed upto, chunks)
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

    def _handoff_checksums(self, request_id: str, ids: list[int]) -> list[int]:
        """Checksums of blocks ``ids``: those hashed in the background as they completed, the rest now."""
        _, chunks = self._hashing.pop(request_id, (0, []))
        out: list[int] = []
        for chunk_ids, fut in chunks:
            if ids[len(out):len(out) + len(chunk_ids)] != chunk_ids:
                break
            out += fut.result()
        return out + block_checksums(self.kv_cache, ids[len(out):], self.checksum_algo)

    def _on_request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or self.server is None:
            self._hashing.pop(request.request_id, None)
            return False, None
        n = min(len(request.block_hashes), len(block_ids))
        ids = list(block_ids[:n])
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
               "remote_block_ids": ids, "remote_request_id": request.request_id,
               "remote_host": self.advertise_host, "remote_port": self.port, "tp_size": 1, "connector": self.name,
               "fingerprint": self.fingerprint, "block_hashes": [h.hex() for h in request.block_hashes[:n]],
               **kv_auth.lora_identity(request)}
        if not ids:
            self._hashing.pop(request.request_id, None)
            return False, kv_auth.sign_params(out, self.secret, self.leases.lease_s)
        if self.verify_checksums:   # hex strings: JSON routers copy these params, and may not keep 64-bit ints exact
            out["checksum_algo"] = self.checksum_algo
            out["block_checksums"] = [f"{c:x}" for c in self._handoff_checksums(request.request_id, ids)]
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
        sums = p.get("block_checksums") if self.verify_checksums else None
        algo = int(p.get("checksum_algo", ALGO_CRC32))
        if sums is not None and (algo not in ALGOS or len(sums) < max(i for i, _, _ in job.blocks) + 1):
            raise CorruptBlock(f"checksums of {p.get('remote_request_id')} are unusable (algorithm {algo})")
        checks: list[tuple[int, int, Future]] = []   # (start, end, checksums of local[start:end])

        def verify_chunk(start: int, end: int) -> None:   # a chunk landed: hash it while later chunks move
            if sums is not None:
                checks.append((start, end, block_codec.hash_pool().submit(
                    block_checksums, self.kv_cache, local[start:end], algo)))

        try:
            self._read(job, peer, local, remote, lease_id, on_chunk=verify_chunk)
        finally:
            for _, _, fut in checks:   # no hash may still read the blocks once this load ends
                fut.exception()
        read = [[i, r, h.hex()] for (i, _, h), r in zip(job.blocks, remote)]
        verdict = self._call(peer, "done", {"lease_id": lease_id, "blocks": read}).get("verdict")
        if verdict == "mismatch":
            raise CorruptBlock(f"prefill says the params of {p.get('remote_request_id')} do not match its lease")
        if verdict != "valid":
            raise LeaseExpired(f"lease of {p.get('remote_request_id')} expired before the read completed")
        errors: dict[int, KVLoadError] = {}
        if sums is None:
            return errors
        covered = sum(e - s for s, e, _ in checks)
        if covered != len(local):   # a _read that reported no chunks (tests wrap it): verify everything now
            checks = [(0, len(local), block_codec.hash_pool().submit(block_checksums, self.kv_cache, local, algo))]
        for start, end, fut in checks:
            for (i, b, _), got in zip(job.blocks[start:end], fut.result()):
                if f"{got:x}" != sums[i]:
                    errors[b] = CorruptBlock(f"block {i} checksum differs from the prefill's at handoff")
        return errors

    def _read(self, job: LoadJob, peer: Peer, local: list[int], remote: list[int], lease_id: str | None,
              on_chunk: Callable[[int, int], None] | None = None) -> None:
        """READ ``remote`` blocks into ``local`` ones in chunks, ``max_inflight`` at a time, calling ``on_chunk(start,
        end)`` as each chunk lands (in order of completion)."""
        with self._lock:
            if job.cancelled:
                raise LoadTimeout("load cancelled after its deadline")
        todo = [(s, min(s + self.chunk_blocks, len(local))) for s in range(0, len(local), self.chunk_blocks)]
        todo.reverse()
        inflight: list[tuple[int, int, Any]] = []
        try:
            deadline = time.monotonic() + self.load_timeout_s
            next_beat = time.monotonic() + self.leases.lease_s / 3
            while todo or inflight:
                while todo and len(inflight) < self.max_inflight:
                    start, end = todo.pop()
                    handle = self.agent.make_prepped_xfer("READ", self._local_descs, local[start:end], peer.descs,
                                                          remote[start:end])
                    inflight.append((start, end, handle))
                    if self.agent.transfer(handle) not in ("PROC", "DONE"):
                        raise PeerUnreachable(f"NIXL READ from {peer.agent_name} could not start")
                for item in list(inflight):
                    state = self.agent.check_xfer_state(item[2])
                    if state == "DONE":
                        inflight.remove(item)
                        item[2].release()
                        if on_chunk is not None:
                            on_chunk(item[0], item[1])
                    elif state != "PROC":
                        raise PeerUnreachable(f"NIXL READ from {peer.agent_name} failed ({state})")
                if not inflight and not todo:
                    break
                now = time.monotonic()
                if job.cancelled:
                    raise LoadTimeout("load cancelled by the watchdog")
                if now > deadline:
                    raise LoadTimeout(f"NIXL READ of {len(local)} blocks not done within {self.load_timeout_s}s")
                if lease_id and now > next_beat:   # a long transfer keeps its lease alive
                    self._call(peer, "heartbeat", {"lease_id": lease_id})
                    next_beat = now + self.leases.lease_s / 3
                time.sleep(0.0002)
        except KVLoadError:
            self._drop_peer(peer)
            raise
        except Exception as e:   # NIXL raises e.g. nixlRemoteDisconnectError for a peer that died
            self._drop_peer(peer)
            raise PeerUnreachable(f"NIXL READ from {peer.agent_name} failed: {e!r}") from e
        finally:
            for _, _, handle in inflight:
                try:
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
