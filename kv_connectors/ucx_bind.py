"""Keep UCX's listeners on the configured address.

UCX's TCP transport opens one listening socket per network interface it uses (every interface by default), so a NIXL
agent would accept connections on the pod's every address even when pdserve was told to serve KV on loopback only.
UCX reads ``UCX_NET_DEVICES`` when an agent's UCX context is created; :func:`bound_to` sets it, for that moment only,
to the interface holding the configured address plus the host's RDMA ports (RDMA opens no TCP listener, and dropping it
would cost the GPU path its fabric). A bind address of ``0.0.0.0``/``::`` means every interface: nothing is changed.
An operator's own ``UCX_NET_DEVICES`` wins (it is left as is); else the connector's ``ucx_net_devices`` config; else
the computed value.

Same-host transfers are unaffected: UCX moves a NIXL READ between two processes of one host with CMA
(``process_vm_readv``, device ``memory``), which ``UCX_NET_DEVICES`` does not filter; only the active-message and
wire-up lanes use TCP on the bound interface (NIXL asks for peer-failure handling, which the posix/sysv shared-memory
transports lack, so they are never selected - checked with ``UCX_PROTO_INFO=y``, UCX 1.23 in nixl 1.5.1).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil

ENV = "UCX_NET_DEVICES"
_lock = threading.Lock()   # the environment is process-wide: one agent creation at a time


def net_devices(host: str) -> str | None:
    """The ``UCX_NET_DEVICES`` value confining UCX to ``host``'s interface (None: ``host`` is every interface)."""
    if host in ("", "0.0.0.0", "::"):
        return None
    addr = socket.gethostbyname(host)
    names = [name for name, addrs in psutil.net_if_addrs().items()
             if any(a.family == socket.AF_INET and a.address == addr for a in addrs)]
    if not names:
        raise ValueError(f"no network interface of this host has the KV bind address {host} ({addr})")
    ib = Path("/sys/class/infiniband")
    rdma = [f"{d.name}:{p.name}" for d in sorted(ib.iterdir()) for p in sorted((d / "ports").iterdir())] \
        if ib.is_dir() else []
    return ",".join([names[0], *rdma])


@contextlib.contextmanager
def bound_to(devices: str | None) -> Iterator[None]:
    """Create UCX contexts (NIXL agents) inside this block to confine them to ``devices``."""
    with _lock:
        if devices is None or os.environ.get(ENV):
            yield
            return
        os.environ[ENV] = devices
        try:
            yield
        finally:
            os.environ.pop(ENV, None)
