"""``pdserve operator``: run the kopf operator reconciling InferenceServices (cluster-wide or in namespaces)."""

from __future__ import annotations

import argparse
import asyncio
import logging

RESYNC_SECONDS = 60.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator reconciling InferenceService resources",
                       description="Reconcile pdserve.dev/v1alpha1 InferenceServices into Deployments, Services, RBAC "
                       "and a ConfigMap. Uses the in-cluster service account, else KUBECONFIG.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default when "
                       "no --namespace is given)")
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch only this namespace (repeatable; globs like 'team-*' allowed)")
    p.add_argument("--resync-seconds", type=float, default=RESYNC_SECONDS,
                   help="period of the drift-repair timer per InferenceService (default %(default)s)")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", metavar="URL",
                   help="liveness endpoint served by kopf (default %(default)s; 'none' disables it)")
    p.add_argument("--autoscale-tick-seconds", type=float, default=5.0,
                   help="how often the autoscaler checks each autoscaled InferenceService (it acts once per "
                   "spec.autoscaling.intervalSeconds; default %(default)s)")
    p.add_argument("--metrics", default="none", metavar="HOST:PORT",
                   help="serve the operator's Prometheus metrics (pdserve_operator_*) here (default: off)")
    p.add_argument("--log-format", choices=["json", "plain", "full"], default="json",
                   help="log line format (default %(default)s: one JSON object per line)")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import CollectorRegistry, start_http_server

    from pdserve.operator.handlers import register

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()], log_refkey="object")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    metrics = CollectorRegistry()
    if args.metrics != "none":
        host, _, port = args.metrics.rpartition(":")
        start_http_server(int(port), addr=host or "0.0.0.0", registry=metrics)
    registry = register(kopf.OperatorRegistry(), args.resync_seconds, args.autoscale_tick_seconds, metrics)
    liveness = None if args.liveness == "none" else args.liveness
    try:
        asyncio.run(kopf.operator(registry=registry, standalone=True, liveness_endpoint=liveness,
                                  clusterwide=not args.namespace, namespaces=args.namespace))
    except KeyboardInterrupt:
        pass
    return 0
