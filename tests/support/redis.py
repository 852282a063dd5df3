"""A real ``redis-server`` (Debian's) on a free loopback port, for tests.

    with redis_server(password="s3cret") as r:
        client = redis.Redis.from_url(r.url)      # url carries the password (and user, if given)
        r.kill()                                  # SIGKILL mid-test: the "Redis went down" fault
        r.restart()                               # same port, empty data

Persistence is off (``--save '' --appendonly no``), data lives in a temp dir, and the server is stopped on exit.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.server import free_port


@dataclass
class RedisServer:
    port: int
    dir: Path
    password: str | None = None
    username: str | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = ""
        if self.password:
            auth = f"{self.username or ''}:{self.password}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]
        if self.username:
            cmd += ["--user", "default", "off", "--user", self.username, "on", f">{self.password}", "~*", "&*", "+@all"]
        elif self.password:
            cmd += ["--requirepass", self.password]
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        while True:
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {(self.dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(password: str | None = None, username: str | None = None) -> Iterator[RedisServer]:
    """Start ``redis-server`` on 127.0.0.1 and a free port; stop it and delete its temp dir on exit."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
    server = RedisServer(free_port(), tmp, password, username)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
