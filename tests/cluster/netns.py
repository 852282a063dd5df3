"""A private network namespace for the one-node cluster, and a way for this process to work inside it.

The node's addresses (NODE_IP on ``node0``, the pod bridge, Service ClusterIPs) exist only inside the namespace.
``node0`` is a bridge with no ports (the kernel here has no dummy driver): its address is local and the default route
into it goes nowhere, so nothing can leave the namespace. Deleting the namespace removes
its interfaces, bridges and iptables rules with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def network_namespace(name: str, node_cidr: str) -> Iterator[Path]:
    """Create netns ``name`` with lo up and ``node0`` holding ``node_cidr``; yields /run/netns/<name>.

    The calling thread (and every process and thread it starts meanwhile) runs inside the namespace until exit.
    """
    _ip("netns", "add", name)
    path = Path("/run/netns") / name
    try:
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "node0", "type", "bridge"],
                    ["addr", "add", node_cidr, "dev", "node0"], ["link", "set", "node0", "up"],
                    ["route", "add", "default", "dev", "node0"]):
            _ip("-n", name, *cmd)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        inside = os.open(path, os.O_RDONLY)
        try:
            _setns(inside)
            try:
                yield path
            finally:
                _setns(home)
        finally:
            os.close(inside)
            os.close(home)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
