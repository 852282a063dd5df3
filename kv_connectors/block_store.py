"""The storage a store connector (disk, Redis) keeps KV blocks in: bytes under block hashes, every call bounded."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.kv_connectors import block_codec


class BlockStore(ABC):
    """Bytes under block hashes. Implementations bound every call with a timeout."""

    @abstractmethod
    def put_many(self, items: list[tuple[bytes, bytes, memoryview]]) -> None:
        """Store (block hash, header, payload) records."""

    @abstractmethod
    def get_many(self, hashes: list[bytes]) -> list[bytes | memoryview | None]:
        """The stored records (None where absent). Raises KVLoadError when the store itself fails."""

    @abstractmethod
    def contains_many(self, hashes: list[bytes]) -> list[bool]:
        ...

    def read_into(self, block_hash: bytes, dest: memoryview) -> block_codec.Header:
        """Optional single-copy read: the payload straight into ``dest``, returning the parsed (unverified) header.
        Raises MissingBlock / TruncatedBlock / CorruptBlock."""
        raise NotImplementedError

    direct = False   # True when read_into is implemented
    put_threads = 1  # how many put_many calls may usefully run at once, each on its own thread (independent writes)

    @abstractmethod
    def delete_many(self, hashes: list[bytes]) -> None:
        """Remove records (absent ones are fine)."""

    def close(self) -> None:
        pass
