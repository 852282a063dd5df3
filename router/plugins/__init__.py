"""Router plugins, one module each; importing this package registers them all with the framework."""

from pdserve.router.plugins import (  # noqa: F401
    health_filter,
    inflight_scorer,
    kv_usage_scorer,
    least_loaded,
    load_guard,
    lora_affinity,
    lora_filter,
    max_score,
    precise_prefix,
    queue_scorer,
    round_robin,
    route_history,
    session_affinity,
)
