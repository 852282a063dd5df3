"""NIXL connector, decode side: a request with ``do_remote_prefill`` params whose signature checks out (anything else is
ignored before any connection: no client can make a decode pod dial an address it names) and a lease claims the listed
blocks that match its own prompt beyond its local prefix hits and loads them in a background thread: handshake
(mutually authenticated, bound to the peer's engine id and address, so no relay; cached per peer; a peer whose call
fails is dropped and re-handshaken next time), fingerprint check before any transfer, the READ in chunks of
``chunk_blocks`` blocks with up to ``max_inflight`` in flight under one deadline (heartbeats keep the lease alive
while a long one runs), each chunk's checksums verified by the hash threads as soon as it lands (on one host UCX
copies with CMA inside the post itself, so that is before the next chunk is posted) while later chunks still move,
then ``done`` (its connection opened and greeted during the READ): only a lease still valid after the read proves the prefill blocks were never freed and
reused during it, so an expired lease fails the load (``lease_expired``) instead of returning wrong tokens, and params
edited to point elsewhere fail it (``corrupt``). A block whose checksum differs is reported bad (the engine cuts the
request's prefix back to its first bad block and recomputes from there); a READ that fails (peer gone) fails the whole
load. ``verify_checksums``: default on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from pdserve.kv_connectors import block_codec, side_channel
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec
from pdserve.kv_connectors.block_codec import ALGO_CRC32, ALGOS, block_checksums
from pdserve.kv_connectors.load_errors import (CorruptBlock, FingerprintMismatch, KVLoadError, LeaseExpired,
                                               LoadTimeout, PeerUnreachable, logger)
from pdserve.kv_connectors.loading import LoadingConnector, LoadJob


@dataclass
class Peer:
    host: str
    port: int
    engine_id: str
    agent_name: str
    descs: Any   # prepped remote descriptor list, one descriptor per remote block
    num_blocks: int


class NixlReader(LoadingConnector):
    """The decode half of :class:`~pdserve.kv_connectors.nixl_connector.NixlConnector`, which sets up what it uses:
    ``agent``, ``_local_descs``, ``token``, ``engine_id``, ``handshake_timeout_s``, ``verify_checksums``,
    ``leases``. Config: ``chunk_blocks`` (16), ``max_inflight`` (4)."""

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        super().__init__(role, config, spec)
        self.chunk_blocks = max(1, int(config.get("chunk_blocks", 16)))
        self.max_inflight = max(1, int(config.get("max_inflight", 4)))
        self._peers: dict[tuple[str, int], Peer] = {}

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

    def _call(self, peer: Peer, op: str, body: dict, conn: side_channel.Opened | None = None) -> dict:
        """One side-channel call to ``peer``, on ``conn`` (from :meth:`_open`) while it is fresh, else a new one."""
        try:
            if conn is not None and conn.fresh():
                try:
                    return conn.request(op, body)
                except PeerUnreachable as e:   # e.g. the peer's own (shorter) connection deadline closed it first;
                    if isinstance(e, side_channel.SideChannelError):   # a request it read, it answers: one fresh
                        raise                                          # try (a repeated "done" fails closed)
                    logger.debug("nixl: %s on the connection opened ahead failed (%r): calling anew", op, e)
            return side_channel.call(peer.host, peer.port, self.token, op, body, self.handshake_timeout_s,
                                     client_id=self.engine_id, server_engine_id=peer.engine_id)
        except KVLoadError:
            self._drop_peer(peer)
            raise

    def _open(self, peer: Peer) -> side_channel.Opened | None:
        """A connection to ``peer`` with its hello in, for a later call; None if that fails now (the call then connects
        anew, and reports what it finds)."""
        try:
            return side_channel.opened(peer.host, peer.port, self.token, self.handshake_timeout_s,
                                       client_id=self.engine_id, server_engine_id=peer.engine_id)
        except KVLoadError as e:
            logger.debug("nixl: opening the side channel to %s ahead failed: %r", peer.agent_name, e)
            return None

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

        done_conn = self._open(peer)   # the "done" call's connect and hello overlap the READ
        try:
            self._read(job, peer, local, remote, lease_id, on_chunk=verify_chunk)
            read = [[i, r, h.hex()] for (i, _, h), r in zip(job.blocks, remote)]
            verdict = self._call(peer, "done", {"lease_id": lease_id, "blocks": read}, done_conn).get("verdict")
        finally:   # "done" concerns the peer's blocks only: the last chunks' hashes run during its round trip
            if done_conn is not None:
                done_conn.close()
            for _, _, fut in checks:   # no hash may still read the blocks once this load ends
                fut.exception()
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
            try:
                sums_got = fut.result(self.load_timeout_s)
            except FutureTimeout:
                raise LoadTimeout(f"checksums of {end - start} blocks not done in time") from None
            for (i, b, _), got in zip(job.blocks[start:end], sums_got):
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
                    state = self.agent.transfer(handle)
                    if state == "DONE":   # one host: UCX copies with CMA inside the post, so hand the chunk to
                        inflight.pop()    # its hash now, while the next chunk's copy runs (not after max_inflight)
                        handle.release()
                        if on_chunk is not None:
                            on_chunk(start, end)
                    elif state != "PROC":
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
