"""pdserve: Kubernetes-native LLM serving with disaggregated prefill and decode.

The source folders at the repository root map onto this namespace (see pyproject.toml):
runtime/ -> pdserve.runtime, router/ -> pdserve.router, kv_connectors/ -> pdserve.kv_connectors,
kernels/ -> pdserve.kernels, operator/ -> pdserve.operator.
"""

__version__ = "0.1.0"
