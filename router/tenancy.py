"""``cache_salt`` set by the router from the tenant's identity, not taken from the client.

Why: prefix caching is shared by everyone on a pod, and ``usage.prompt_tokens_details.cached_tokens`` (or simply the
time to first token) tells a client whether the blocks of a prompt it guessed were already cached, i.e. whether
someone else sent that prompt. vLLM's answer is ``cache_salt``: blocks hash with the salt, so requests with
different salts never share cache. But a client-chosen salt isolates nothing against a tenant who reuses another's
salt. The router is the trusted gateway, so with ``cache_salt_from`` set it derives the salt itself:

    salt = HMAC-SHA256(secret, identity [+ NUL + client salt])

- ``identity`` is the bearer token the client authenticated with (``api-key``; ``X-Api-Key`` works too), or the
  value of a header that an authenticating gateway in front of the router sets (``header``, ``tenant_header``).
- A client salt is mixed in, not trusted: a tenant can still split its own cache, never reach another's.
- ``secret`` must be shared by all router replicas (else each derives different salts and the cache is split per
  replica); without one, a random per-process secret is used and a warning logged.
A request without an identity in these modes is refused (401), since it could otherwise share a salt-less cache.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any, Literal

log = logging.getLogger(__name__)

SaltSource = Literal["client", "api-key", "header"]


class MissingTenant(Exception):
    pass


class CacheSalter:
    def __init__(self, source: SaltSource, tenant_header: str, secret: str | None):
        self.source = source
        self.tenant_header = tenant_header.lower()
        if source != "client" and not secret:
            log.warning("cache salts derive from a random per-process secret: set --cache-salt-secret (or "
                        "PDSERVE_CACHE_SALT_SECRET) to the same value on every router replica")
        self._key = (secret or secrets.token_hex(32)).encode()

    @property
    def active(self) -> bool:
        return self.source != "client"

    def identity(self, headers: dict[str, str]) -> str | None:
        if self.source == "header":
            return headers.get(self.tenant_header) or None
        auth = headers.get("authorization", "")
        return (auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")) or None

    def salt(self, headers: dict[str, str], client_salt: Any) -> str:
        ident = self.identity(headers)
        if ident is None:
            need = f"header {self.tenant_header}" if self.source == "header" else "an API key"
            raise MissingTenant(f"a tenant identity is required ({need})")
        msg = ident.encode("utf-8", "surrogateescape")
        if isinstance(client_salt, str) and client_salt:
            msg += b"\0" + client_salt.encode("utf-8", "surrogatepass")
        return "t-" + hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:40]

    def apply(self, headers: dict[str, str], body: dict[str, Any]) -> None:
        """Set ``body["cache_salt"]`` to the tenant's salt (in place)."""
        body["cache_salt"] = self.salt(headers, body.get("cache_salt"))
