"""pdserve.router: the prefix- and load-aware OpenAI proxy that orchestrates prefill -> decode.

Map (one concept per module):
- ``cli``: ``pdserve router`` flags -> ``config.RouterConfig``; ``app``: the raw-ASGI app (admission, routes,
  lifecycle) served by ``http_server`` (one write per response); ``proxy``: life of one request (route, P/D, relay);
  ``pd``: the ``kv_transfer_params`` handoff; ``upstream`` + ``http_client``: pooled HTTP to pods with retries before
  the first byte; ``circuit_breaker``, ``health`` (active checks + load scrape), ``metrics``.
- Endpoints: ``endpoints`` (pool + per-pod state), ``discovery`` (static URLs or Kubernetes pods, watched).
- Scheduling: ``framework`` (Filter -> Scorer -> Picker, registry), ``policies`` (named profiles), ``plugins/`` (one
  module per plugin), ``prefix_index`` + ``kv_event_subscriber`` (which pod holds which block, from KV events),
  ``prompt`` (chat template + tokenizer + shared block hashes).
"""
