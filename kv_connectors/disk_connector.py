"""Disk connector: one file per block under a (shared) directory, keyed by block hash.

Layout: ``<path>/<fingerprint>/<hash[:2]>/<hash>.kvb``. Files are written to a temp file in the same directory and
``os.replace``d into place, so a reader sees a whole record or none (also across engines sharing the directory).
A read bumps the file's mtime (at most every 30 s); when the directory's size passes ``max_bytes`` the least recently used files are
deleted down to 90% of it (other engines sharing the directory just miss them later).

Config: ``path`` (required), ``max_bytes`` (default 8 GiB), plus the StoreConnector keys.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.kv_connectors import block_codec
from pdserve.kv_connectors.base import register_connector
from pdserve.kv_connectors.load_errors import CorruptBlock, KVLoadError, MissingBlock, TruncatedBlock, logger
from pdserve.kv_connectors.block_store import BlockStore
from pdserve.kv_connectors.store_connector import StoreConnector


class DiskStore(BlockStore):
    direct = True
    put_threads = max(1, min(4, os.cpu_count() or 1))   # a file per block: writes are independent, and each one is
    # a copy into the page cache on the calling thread, so a save of many blocks scales with the threads writing it
    _tmp_ids = itertools.count()

    def __init__(self, path: str | os.PathLike, fingerprint: str, max_bytes: int = 8 << 30) -> None:
        self.root = Path(path) / fingerprint
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._dirs: set[str] = set()   # fan-out subdirectories known to exist
        self.touch_after_s = 30.0      # LRU granularity: a read refreshes mtime when it is older than this
        self._size = sum(e.stat().st_size for e in self._entries())

    def _path(self, h: bytes) -> Path:
        name = h.hex()
        return self.root / name[:2] / f"{name}.kvb"

    def _entries(self) -> list[os.DirEntry]:
        out = []
        for sub in os.scandir(self.root):
            if sub.is_dir():
                out += [e for e in os.scandir(sub.path) if e.name.endswith(".kvb")]
        return out

    def put_many(self, items: list[tuple[bytes, bytes, memoryview]]) -> None:
        written = 0
        root, pid, tid = str(self.root), os.getpid(), threading.get_ident()
        try:
            for h, header, payload in items:   # plain str paths: pathlib's joins cost more than the write per block
                name = h.hex()
                sub = f"{root}/{name[:2]}"
                if name[:2] not in self._dirs:
                    os.makedirs(sub, exist_ok=True)
                    self._dirs.add(name[:2])
                tmp = f"{sub}/.tmp-{pid}-{tid}-{next(self._tmp_ids)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    try:
                        n = os.writev(fd, [header, payload])
                        while n < len(header) + len(payload):   # a short write (rare): finish it
                            n += os.write(fd, payload[n - len(header):])
                    finally:
                        os.close(fd)
                    os.replace(tmp, f"{sub}/{name}.kvb")
                except BaseException:
                    os.unlink(tmp)
                    raise
                written += len(header) + len(payload)
        except OSError as e:
            raise KVLoadError(f"disk write failed: {e}") from e
        with self._lock:
            self._size += written
            over = self._size > self.max_bytes
        if over:
            self.evict()

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for h in hashes:
            path = self._path(h)
            try:
                with open(path, "rb", buffering=0) as f:
                    out.append(f.read())
                self._touch(path)
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise KVLoadError(f"disk read failed: {e}") from e
        return out

    def contains_many(self, hashes: list[bytes]) -> list[bool]:
        return [self._path(h).exists() for h in hashes]

    def delete_many(self, hashes: list[bytes]) -> None:
        for h in hashes:
            try:
                os.unlink(self._path(h))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise KVLoadError(f"disk delete failed: {e}") from e

    def read_into(self, block_hash: bytes, dest: memoryview) -> block_codec.Header:
        # One readv for the whole record (header into a small buffer, payload straight into ``dest``); a short read
        # (a signal, a pipe) goes on where it stopped. The size check applies to regular files only.
        name = block_hash.hex()
        path = f"{self.root}/{name[:2]}/{name}.kvb"
        head = memoryview(bytearray(block_codec.HEADER_SIZE))
        want = len(head) + len(dest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise MissingBlock(f"block {name[:16]} is not on disk") from e
        except OSError as e:
            raise KVLoadError(f"disk read failed: {e}") from e
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size != want:
                raise TruncatedBlock(f"{name[:16]}: {st.st_size} bytes, want {want}")
            got = 0
            while got < want:
                n = os.readv(fd, [head[got:], dest] if got < len(head) else [dest[got - len(head):]])
                if not n:
                    break
                got += n
            if got < want:
                raise TruncatedBlock(f"{name[:16]}: {got} bytes, want {want}")
            header = block_codec.parse_header(head)
            if header.length != len(dest):
                raise CorruptBlock(f"payload of {header.length} bytes, the block has {len(dest)}")
        except OSError as e:
            raise KVLoadError(f"disk read failed: {e}") from e
        finally:
            os.close(fd)
        if time.time() - st.st_mtime > self.touch_after_s:
            self._touch(path)
        return header

    @staticmethod
    def _touch(path: Path | str) -> None:
        try:
            os.utime(path)   # LRU: a read counts as a use
        except OSError:      # evicted meanwhile: the read already has its bytes
            pass

    def evict(self) -> int:
        """Delete least recently used files until the directory is under 90% of ``max_bytes``; returns files removed."""
        entries = []
        for e in self._entries():
            try:
                st = e.stat()
                entries.append((st.st_mtime, st.st_size, e.path))
            except FileNotFoundError:
                pass
        total = sum(s for _, s, _ in entries)
        removed = 0
        for _, size, path in sorted(entries):
            if total <= self.max_bytes * 0.9:
                break
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            total -= size
        with self._lock:
            self._size = total
        logger.info("disk KV store %s: evicted %d blocks, %d bytes left", self.root, removed, total)
        return removed


@register_connector("disk")
class DiskConnector(StoreConnector):
    name = "disk"

    def _make_store(self, config: dict[str, Any]) -> DiskStore:
        if not config.get("path"):
            raise ValueError('the disk connector needs {"path": "<directory>"} in its config')
        return DiskStore(config["path"], self.spec.fingerprint(), int(config.get("max_bytes", 8 << 30)))
