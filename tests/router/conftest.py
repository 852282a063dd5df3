"""Shared router test fixtures: fake OpenAI pods on loopback, a router factory, the default model's tokenizer."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from pdserve.router.app import RouterApp
from pdserve.router.config import RouterConfig
from tests.router.fake_pod import FakePod, FakeState, ServerThread


@pytest.fixture(scope="session")
def tokenizer():
    from pdserve.router.prompt import PromptTokenizer, default_tokenizer_path

    path = default_tokenizer_path()
    if path is None:
        pytest.fail("the default model's tokenizer could not be resolved")
    return PromptTokenizer(path)


@pytest.fixture(scope="module")
def fake_pods():
    """Three fake pods; tests reset their state through ``reset``."""
    pods = [FakePod(FakeState(name=f"p{i}")) for i in range(3)]
    servers = [ServerThread(p).start() for p in pods]
    yield list(zip(pods, servers))
    for s in servers:
        s.stop()


@pytest.fixture
def pods(fake_pods):
    for i, (pod, _) in enumerate(fake_pods):
        pod.state = FakeState(name=f"p{i}")
    return fake_pods


@pytest.fixture
def make_router():
    started = []

    def make(cfg: RouterConfig, **kw) -> tuple[RouterApp, ServerThread]:
        if cfg.health_interval == RouterConfig.health_interval:  # default: check often in tests
            cfg = replace(cfg, health_interval=0.2)
        app = RouterApp(cfg, **kw)
        srv = ServerThread(app, router=True).start()
        started.append(srv)
        return app, srv

    yield make
    for s in started:
        with contextlib.suppress(Exception):
            s.stop()
