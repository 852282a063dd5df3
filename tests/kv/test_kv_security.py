"""The attacks on the KV path (issue 20), each with real processes, now failing closed.

One module-scoped pair of real pods on loopback sharing the deployment's KV secret: P (``pdserve serve --role prefill``,
NIXL) and D (``--role decode``, NIXL); a real ``pdserve router`` process where a test needs one. An "attacker" is a plain
TCP listener on loopback: a test asserts it never received a connection.

(a) forged ``kv_transfer_params`` sent straight to D, naming the attacker's listener (unsigned, signature of other
    params, correctly signed but expired): no connection, the right greedy answer, the counter says why;
(b) the same through the router when the prompt is under ``--pd-threshold``: the router drops the client's params;
    and the router's own P/D handoff (handoff header + signed params) still loads the KV;
(c) a relay of P's side-channel challenge gets nothing (tests/kv/test_kv_auth.py relays in-process; here against the
    real prefill pod's side channel);
(d) an unauthenticated ``do_remote_decode`` request to P: 403, OpenAI-shaped, no lease;
(e) ``pdserve serve`` with a connector and no secret refuses to start, saying what to do;
(f) every listening socket of both pods (HTTP, side channel, UCX) is on the configured address only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import httpx
import psutil
import pytest

from pdserve.kv_connectors import kv_auth, side_channel
from tests.kv.test_kv_auth import Relay
from tests.support.deps import require
from tests.support.server import free_port, launch_process, launch_server

require("nixl_cu12", "nixl-cu12 is not installed")
pytestmark = pytest.mark.slow

SECRET = "kv-security-test-secret"
MODEL = "SmolLM2-135M-Instruct"
STORY = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to the "
         "waves break against the rocks below, while the lamp slowly warmed and the ships far out at sea waited. ")
MAX_TOKENS = 8


def prompt(case: str) -> str:
    return f"Case {case}. " + STORY * 2


@pytest.fixture(scope="module")
def pods():
    env = {"PDSERVE_KV_TOKEN": SECRET}
    # float32: the router test compares P/D output with P's own answer token for token (bf16 is not batch-invariant)
    common = ["--num-gpu-blocks", "200", "--max-model-len", "1024", "--max-num-seqs", "8", "--dtype", "float32"]
    side = free_port()
    p_cfg = json.dumps({"host": "127.0.0.1", "port": side, "handshake_timeout_s": 2, "load_timeout_s": 10})
    d_cfg = json.dumps({"host": "127.0.0.1", "handshake_timeout_s": 2, "load_timeout_s": 10})
    with launch_server(*common, "--role", "prefill", "--kv-connector", "nixl", "--kv-connector-config", p_cfg,
                       env=env) as p, \
            launch_server(*common, "--role", "decode", "--kv-connector", "nixl", "--kv-connector-config", d_cfg,
                          env=env) as d:
        p.side_port = side
        yield p, d


def complete(url: str, text: str, params: dict | None = None, headers: dict | None = None,
             raw: bytes | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + "/v1/completions", content=data, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


def handoff(p, text: str) -> dict:
    """What the router does: ask P to prefill and hold the prompt, proving it with the KV secret."""
    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0,
                       "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}).encode()
    r = complete(p.url, text, raw=body, headers={kv_auth.HANDOFF_HEADER: kv_auth.handoff_header(SECRET.encode(), body)})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    return params


def metric(url: str, name: str, label: str = "") -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ") and label in line)


class Listener:
    """The attacker's address: a listening socket that records whether anyone connected."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def connected(self) -> bool:
        self.sock.settimeout(0.5)
        try:
            conn, _ = self.sock.accept()
            conn.close()
            return True
        except socket.timeout:
            return False

    def close(self) -> None:
        self.sock.close()


REJECTED = "pdserve:kv_connector_params_rejected_total"


def _forge(params: dict, port: int, how: str) -> dict:
    evil = {**params, "remote_host": "127.0.0.1", "remote_port": port, "remote_engine_id": "attacker"}
    if how == "unsigned":
        return {k: v for k, v in evil.items() if k != kv_auth.SIGNATURE_FIELD}
    if how == "bad_signature":
        return evil                      # the prefill's signature, over other values
    body = {k: v for k, v in evil.items() if k not in (kv_auth.SIGNATURE_FIELD, kv_auth.EXPIRES_FIELD)}
    return kv_auth.sign_params(body, SECRET.encode(), -60)   # signed with the secret, but long expired


def test_prefill_signs_the_whole_parameter_set(pods):
    p, _ = pods
    params = handoff(p, prompt("signed"))
    assert kv_auth.verify_params(params, SECRET.encode()) is None
    assert params[kv_auth.EXPIRES_FIELD] > params["lease_ms"] // 1000 and params["lease_id"]
    assert kv_auth.verify_params({**params, "remote_port": params["remote_port"] + 1}, SECRET.encode()) == \
        "bad_signature"


@pytest.mark.parametrize("how", ["unsigned", "bad_signature", "expired"])
def test_forged_params_to_decode_pod_fail_closed(pods, how):
    p, d = pods
    text = prompt(f"a-{how}")
    reference = complete(p.url, text).json()["choices"][0]["text"]     # an independent engine's greedy answer
    evil = Listener()
    before = metric(d.url, REJECTED, f'reason="{how}"')
    r = complete(d.url, text, _forge(handoff(p, text), evil.port, how))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    assert not evil.connected(), "the decode pod dialled the address the client named"
    assert metric(d.url, REJECTED, f'reason="{how}"') == before + 1
    evil.close()
    again = complete(d.url, text).json()["choices"][0]["text"]          # nothing poisoned D's prefix cache
    assert again == reference


def test_router_strips_client_params_under_the_threshold(pods):
    p, d = pods
    text = prompt("b")
    reference = complete(p.url, text).json()["choices"][0]["text"]
    evil = Listener()
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(port), "--prefill", p.url,
           "--decode", d.url, "--pd-threshold", "100000", "--policy", "round-robin"]
    rejected = metric(d.url, REJECTED)
    with launch_process(cmd, port, env={"PDSERVE_KV_TOKEN": SECRET}) as router:
        forged = _forge(handoff(p, text), evil.port, "unsigned")
        r = complete(router.url, text, forged)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    assert not evil.connected()
    assert metric(d.url, REJECTED) == rejected           # the params never reached D: the router dropped them
    evil.close()


def test_router_handoff_is_authenticated_and_loads(pods):
    """The router's own P/D path: its handoff header is accepted by P, D verifies P's signed params and loads."""
    p, d = pods
    text = prompt("router-pd") * 2
    reference = complete(p.url, text).json()["choices"][0]["text"]
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(port), "--prefill", p.url,
           "--decode", d.url, "--pd-threshold", "0", "--policy", "round-robin"]
    loaded = metric(d.url, "pdserve:kv_connector_blocks_loaded_total")
    with launch_process(cmd, port, env={"PDSERVE_KV_TOKEN": SECRET}) as router:
        r = complete(router.url, text)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    assert metric(d.url, "pdserve:kv_connector_blocks_loaded_total") > loaded


def test_relay_of_the_prefill_challenge_gets_nothing(pods):
    p, _ = pods
    engine = handoff(p, prompt("c"))["remote_engine_id"]
    failures = metric(p.url, "pdserve:kv_connector_side_channel_auth_failures_total")
    relay = Relay(p.side_port)
    with pytest.raises(side_channel.SideChannelError):   # a decode client that was sent to the relay's address
        side_channel.call("127.0.0.1", relay.port, SECRET.encode(), "meta", {}, 5, client_id="decode",
                          server_engine_id=engine)
    relay.close()
    assert relay.answers == [{"ok": False, "error": "unauthorized"}]   # no agent metadata ever left P
    assert metric(p.url, "pdserve:kv_connector_side_channel_auth_failures_total") == failures + 1


@pytest.mark.parametrize("proof", ["none", "wrong_secret", "other_body"])
def test_unauthenticated_handoff_is_refused(pods, proof):
    p, _ = pods
    text = prompt(f"d-{proof}")
    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1,
                       "kv_transfer_params": {"do_remote_decode": True}}).encode()
    headers = {"none": {}, "wrong_secret": {kv_auth.HANDOFF_HEADER: kv_auth.handoff_header(b"guess", body)},
               "other_body": {kv_auth.HANDOFF_HEADER: kv_auth.handoff_header(SECRET.encode(), body + b" ")}}[proof]
    leases = metric(p.url, "pdserve:kv_connector_leases_active")
    rejected = metric(p.url, "pdserve:kv_connector_handoffs_rejected_total")
    r = complete(p.url, text, raw=body, headers=headers)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_handoff_unauthorized" and err["type"] == "permission_error" and "X-PDServe" in err["message"]
    assert metric(p.url, "pdserve:kv_connector_leases_active") <= leases      # nothing pinned
    assert metric(p.url, "pdserve:kv_connector_handoffs_rejected_total") == rejected + 1


@pytest.mark.parametrize("connector,config", [("nixl", "{}"), ("disk", '{"path": "/tmp/pdserve-unused-kv"}')])
def test_serve_refuses_a_connector_without_secret(connector, config):
    env = {**os.environ, "PDSERVE_KV_TOKEN": ""}
    cmd = [sys.executable, "-m", "pdserve", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--role", "decode", "--kv-connector", connector, "--kv-connector-config", config]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "PDSERVE_KV_TOKEN" in res.stderr and "--kv-insecure" in res.stderr


def test_kv_insecure_is_explicit():
    from pdserve.cli import build_parser
    from pdserve.runtime.cli import check_kv_secret

    argv = ["serve", "--kv-connector", "disk", "--kv-connector-config", '{"path": "/tmp/x"}']
    args = build_parser(argv).parse_args(argv)
    assert check_kv_secret(args) is None                      # the test deployment's secret is in the environment
    saved = os.environ.pop("PDSERVE_KV_TOKEN")
    try:
        assert "PDSERVE_KV_TOKEN" in check_kv_secret(build_parser(argv).parse_args(argv))
        args = build_parser(argv).parse_args([*argv, "--kv-insecure"])
        assert check_kv_secret(args) is None and args.kv_connector_config["insecure"] is True
    finally:
        os.environ["PDSERVE_KV_TOKEN"] = saved


def test_listeners_bind_the_configured_address_only(pods):
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not others:
        pytest.skip("this host has no non-loopback IPv4 interface: a listener on 'every interface' would look the same")
    for pod in pods:
        proc = psutil.Process(pod.proc.pid)
        conns = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
        listening = sorted({(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN})
        assert len(listening) >= 2                               # HTTP, and UCX (plus P's side channel)
        assert all(ip == "127.0.0.1" for ip, _ in listening), listening
