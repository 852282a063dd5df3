"""Redis connector: blocks under ``<key_prefix><fingerprint>:<block hash hex>`` with a TTL, so Redis doubles as a
prefix cache shared by every pod of a deployment (and as the P/D handoff medium).

Every call has a socket timeout and no client-side retries, so a Redis that is down makes loads fail within about
``socket_timeout_s`` (reported as ``peer_unreachable`` or ``timeout`` load errors) and saves be skipped and counted;
after a failure the store is skipped for ``retry_after_s``. Writes (chunks of 32 blocks, each SET written as RESP
straight from the record's header and the block's bytes, no joined copy) and reads (one round trip per load) are
pipelined; a read refreshes the block's TTL (GETEX), so hot prefixes stay.

Config: ``url`` (required, ``redis://`` or ``rediss://``; may carry user:password), ``password``, ``username``,
``ttl_s`` (3600), ``socket_timeout_s`` (2), ``connect_timeout_s`` (1), ``key_prefix`` ("pdserve:kv:"), and TLS:
``ssl`` (bool), ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` ("required").
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.kv_connectors.base import register_connector
from pdserve.kv_connectors.load_errors import KVLoadError, LoadTimeout, PeerUnreachable
from pdserve.kv_connectors.block_store import BlockStore
from pdserve.kv_connectors.store_connector import StoreConnector


_CHUNK = 32


def _translate(e: redis.RedisError) -> KVLoadError:
    if isinstance(e, redis.TimeoutError):
        return LoadTimeout(f"redis timed out: {e}")
    if isinstance(e, redis.ConnectionError):
        return PeerUnreachable(f"redis unreachable: {e}")
    return KVLoadError(f"redis error: {e}")


class RedisStore(BlockStore):
    def __init__(self, config: dict[str, Any], fingerprint: str) -> None:
        if not config.get("url"):
            raise ValueError('the redis connector needs {"url": "redis://host:port"} in its config')
        kwargs: dict[str, Any] = dict(
            socket_timeout=float(config.get("socket_timeout_s", 2.0)),
            socket_connect_timeout=float(config.get("connect_timeout_s", 1.0)),
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        for key in ("password", "username"):
            if config.get(key):
                kwargs[key] = config[key]
        if config.get("ssl"):
            kwargs["ssl"] = True  # also implied by a rediss:// url
        for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
            if config.get(key):
                kwargs[key] = config[key]
        self.client = redis.Redis.from_url(config["url"], **kwargs)
        self.ttl_s = int(config.get("ttl_s", 3600))
        self.prefix = f"{config.get('key_prefix', 'pdserve:kv:')}{fingerprint}:".encode()
        self._set_tail = b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self.ttl_s)), self.ttl_s)   # a SET's value end, EX

    def key(self, h: bytes) -> bytes:
        return self.prefix + h.hex().encode()

    def put_many(self, items: list[tuple[bytes, bytes, memoryview]]) -> None:
        # One whole-record SET per block (readers never see half a record), written as RESP on one pooled connection
        # straight from each record's header and payload: joining them into one value first cost a copy of every
        # block, as long as the SETs themselves. Chunks of _CHUNK commands, each chunk's replies read before the next.
        if not items:
            return
        pool, done = self.client.connection_pool, False
        try:
            conn = pool.get_connection()
        except redis.RedisError as e:
            raise _translate(e) from e
        try:
            for start in range(0, len(items), _CHUNK):
                chunk = items[start:start + _CHUNK]
                parts: list[bytes | memoryview] = []
                for i, (h, header, payload) in enumerate(chunk):
                    key = self.key(h)
                    parts.append(b"%s*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
                        self._set_tail if i else b"", len(key), key, len(header) + len(payload), header))
                    parts.append(payload)
                parts.append(self._set_tail)
                conn.send_packed_command(parts, check_health=False)
                for _ in chunk:
                    conn.read_response()   # raises the server's error reply (e.g. OOM) as a ResponseError
            done = True
        except redis.RedisError as e:
            raise _translate(e) from e
        finally:
            if not done:   # replies may be left unread: never hand a connection back mid-stream
                conn.disconnect()
            pool.release(conn)

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.getex(self.key(h), ex=self.ttl_s)
                return pipe.execute()
        except redis.RedisError as e:
            raise _translate(e) from e

    def contains_many(self, hashes: list[bytes]) -> list[bool]:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.exists(self.key(h))
                return [bool(n) for n in pipe.execute()]
        except redis.RedisError as e:
            raise _translate(e) from e

    def delete_many(self, hashes: list[bytes]) -> None:
        try:
            self.client.delete(*[self.key(h) for h in hashes])
        except redis.RedisError as e:
            raise _translate(e) from e

    def close(self) -> None:
        self.client.close()


@register_connector("redis")
class RedisConnector(StoreConnector):
    name = "redis"

    def _make_store(self, config: dict[str, Any]) -> RedisStore:
        return RedisStore(config, self.spec.fingerprint())
