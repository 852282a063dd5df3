"""Request ids: checked at the door, before any work, because they travel in HTTP headers.

A client may name its request with the ``X-Request-Id`` header or a ``request_id`` body field (vLLM's extension; the
pods prefer the body field). Either one ends up in the pod's and the router's ``X-Request-Id`` response headers, so a
value with CR/LF would split the pod's response (the pod drops the connection, which used to count as a pod failure),
and one outside latin-1 cannot be written at all (a 500 after the work was done). The router accepts visible ASCII
only, at most ``MAX_LEN`` characters, and answers anything else with a 400 naming the field.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

MAX_LEN = 256
_VALID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_LEN)


class BadRequestId(ValueError):
    def __init__(self, param: str):
        super().__init__(f"{param} must be 1-{MAX_LEN} visible ASCII characters (no spaces or control characters)")
        self.param = param


def valid(rid: Any) -> bool:
    return isinstance(rid, str) and _VALID.fullmatch(rid) is not None


def resolve(header: str | None, body: dict[str, Any] | None) -> str:
    """The request's id: the body's ``request_id`` (what the pod will use), else the header, else a fresh one.
    Raises ``BadRequestId`` for an id that could not travel safely in a header."""
    if body is not None and body.get("request_id") not in (None, ""):  # (the pods take "" as absent too)
        if not valid(body["request_id"]):
            raise BadRequestId("request_id")
        return body["request_id"]
    if header:
        if not valid(header):
            raise BadRequestId("x-request-id")
        return header
    return uuid.uuid4().hex
