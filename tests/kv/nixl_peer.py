"""A prefill NIXL connector in its own process (for cross-process tests): fills its cache with a seeded pattern,
finishes one handoff request, prints the kv_transfer_params as one JSON line, then serves until killed."""

from __future__ import annotations

import json
import sys
import time

import torch

from pdserve.kv_connectors.base import create_connector
from tests.kv.conftest import SPEC, Req, make_cache, prefill

if __name__ == "__main__":
    port, token, prompt_len = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.manual_seed(1234)
    conn = create_connector("nixl", "prefill", {"port": port, "token": token, "lease_s": 60}, SPEC)
    conn.register_kv_caches(make_cache(fill=True))
    params = prefill(conn, Req("remote", list(range(prompt_len)), {"do_remote_decode": True}), list(range(1, 20)))
    print("PARAMS " + json.dumps(params), flush=True)   # NIXL logs to stdout too
    while True:
        conn.get_finished()
        time.sleep(0.05)
