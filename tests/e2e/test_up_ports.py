"""`pdserve up` (and the tests) pick listening ports below the kernel's ephemeral range, where no outgoing connection
can take them between the pick and the child's bind."""

from __future__ import annotations

import socket

from pdserve import up


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def os_pick() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ports_come_from_below_the_ephemeral_range():
    low = int(up.EPHEMERAL_RANGE.read_text().split()[0])
    ports = {up.free_port() for _ in range(20)}
    assert all(15_000 <= p < min(low, 28_000) and bindable(p) for p in ports), (low, ports)
    assert len(ports) > 1   # picked at random, not one fixed port


def test_a_held_port_is_skipped(monkeypatch, tmp_path):
    free = os_pick()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{max(taken, free) + 1}\t65000\n")   # both count as below the range
        monkeypatch.setattr(up, "EPHEMERAL_RANGE", range_file)
        monkeypatch.setattr(up, "PICK_RANGE", (1024, 65536))
        picks = iter([taken, free])
        monkeypatch.setattr(up.random, "randrange", lambda a, b: next(picks))
        assert up.free_port() == free


def test_no_room_below_the_range_or_no_range_file(monkeypatch, tmp_path):
    range_file = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(up, "EPHEMERAL_RANGE", range_file)
    range_file.write_text("15050\t65000\n")   # no room below the range to pick from: the OS picks
    assert bindable(up.free_port())
    range_file.write_text("not a range\n")   # unreadable: Linux's default range, then the fixed-port-free window
    assert all(15_000 <= up.free_port() < 28_000 for _ in range(5))
