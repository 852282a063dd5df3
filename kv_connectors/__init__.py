"""KV connectors: how prefill and decode pods (and a shared prefix cache) move KV blocks. See ``base.py`` for the
contract; ``create_connector(name, role, config, spec)`` imports ``<name>_connector`` on first use.

=========  ==========================================================================================================
nixl       decode READs the prefill pod's registered cache (UCX); authenticated side channel, leases, checksums.
           config: host, port, advertise_host, token (or PDSERVE_KV_TOKEN), lease_s, handshake_timeout_s,
           load_timeout_s, handoff_timeout_s, verify_checksums, chunk_blocks, max_inflight, progress_interval_s,
           progress_grace_s, backends
redis      blocks under their hash with a TTL (a prefix cache shared by every pod); pipelined; auth and TLS.
           config: url (required), password, username, ttl_s, socket_timeout_s, connect_timeout_s, key_prefix,
           ssl, ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs
disk       one file per block under a (shared) directory, atomic writes, size-capped LRU.
           config: path (required), max_bytes
all        token (else PDSERVE_KV_TOKEN: the deployment's KV secret, required unless insecure), insecure,
           async_load (true), load_timeout_s, load_threads; redis/disk also save, load, retry_after_s,
           handoff_timeout_s, lookup_timeout_s, engine_id, params_ttl_s, max_pending_save_bytes, fetch_chunk,
           read_threads
=========  ==========================================================================================================

Layout: ``kv_auth`` (the secret: signed kv_transfer_params, handoff headers), ``block_codec`` (the on-wire/on-disk
block record), ``load_errors`` (typed failures + counters), ``loading`` (shared load bookkeeping), ``handoff`` (a
prefill handoff's blocking part on the connector's thread, under a deadline), ``block_store`` (the ``BlockStore``
interface), ``store_saving`` and ``store_connector`` (disk/Redis saving + handoff, and loading, over a
``BlockStore``), ``nixl_connector`` (prefill side, registration) and ``nixl_reader`` (decode side: the READ),
``side_channel`` and ``leases`` (NIXL's control plane), ``ucx_bind`` (UCX listeners on the configured address only).

Metrics (``connector.metrics()``; keys carry Prometheus-style labels): ``kv_load_failures{kind=missing|corrupt|
fingerprint|timeout|peer_unreachable|lease_expired}`` (failed request loads), ``kv_blocks_loaded``,
``kv_bytes_loaded``, ``kv_blocks_load_failed``, ``kv_blocks_saved``, ``kv_bytes_saved``, ``kv_saves_skipped``,
``kv_store_errors``, ``kv_params_rejected{reason=unsigned|bad_signature|expired|malformed}`` (kv_transfer_params
ignored before any connection), ``kv_handoffs_rejected`` (403s to unauthenticated do_remote_decode requests),
``kv_saves_dropped_queue_full``, ``kv_loads_overdue`` (disk loads past their deadline, reported once their reads
return); NIXL adds ``kv_leases_active``, ``kv_leases_expired``, ``kv_leases_released``,
``kv_peer_handshakes``, ``kv_peers_dropped``, ``kv_side_channel_auth_failures``, ``kv_side_channel_busy_rejections``,
``kv_handoffs_failed`` (handoffs past ``handoff_timeout_s``: answered without blocks). Every failure is also logged
with the request id.
"""
