"""The InferenceService API: pydantic models of spec and status, the single source of truth of the CRD.

`crdgen` turns these models into the OpenAPI v3 schema of crds/inferenceservice.yaml (CEL rules come from the
``x-kubernetes-validations`` extras below); the builders read a validated ``InferenceServiceSpec``. Fields are camelCase
in YAML (aliases) and snake_case in Python. Optional fields without a default are omitted from the schema's defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from pdserve.operator.names import DEFAULT_IMAGE


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# Kubernetes types we pass through to pod templates unchanged; the API server validates them when the operator
# creates the Deployment (server-side), so the CRD only checks their shape loosely.
KubeObject = dict[str, Any]
_PRESERVE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_DEFAULT_EMPTY = {"default": {}}  # lets the API server fill the nested defaults
_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


class SecretKeyRef(_Model):
    """A key of a Secret in the InferenceService's namespace."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class ModelSpec(_Model):
    name: str = Field(min_length=1, max_length=256, description="Served model name (the OpenAI `model` field); "
                      "immutable.", json_schema_extra=_rules(("self == oldSelf", "model.name is immutable")))
    uri: str = Field("default", max_length=1024, pattern=r"^(default|hf://[^/]+/.+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.*|/.+)$",
                     description="hf://org/name, pvc://claim/path/in/claim, an absolute path in the image, or "
                     "`default` (the image's built-in default model).")
    auth_secret_ref: SecretKeyRef | None = Field(None, description="Hub token for hf:// models (exported as HF_TOKEN).")


class LoRASpec(_Model):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.:]*$",
                      description="The adapter's name in the API (the OpenAI `model` field of its requests).")
    uri: str = Field(max_length=1024, pattern=r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.*|/.+)$",
                     description="A PEFT adapter directory: pvc://claim/path/in/claim or an absolute path in the "
                     "image.")


class LoRAConfigSpec(_Model):
    """How runtime pods serve adapters (the `pdserve serve` LoRA flags). Fixed per pool: the adapter set
    (spec.loras) changes through the pods' load/unload API without a restart, these settings roll the pods."""

    max_loras: int = Field(4, ge=1, le=256, description="Adapters resident on the device at once (`--max-loras`): "
                           "one batch mixes at most this many; more adapters are served by swapping, least recently "
                           "used first. Not derived from the number of spec.loras, so adding one never rolls pods.")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest adapter rank accepted (`--max-lora-rank`).")
    max_cpu_loras: int | None = Field(None, ge=1, le=4096, description="Adapters kept loaded in CPU memory "
                                      "(`--max-cpu-loras`, default maxLoras); others are re-read on use.")


class Resources(_Model):
    requests: dict[str, Any] | None = Field(None, json_schema_extra={"additionalProperties": _QUANTITY})
    limits: dict[str, Any] | None = Field(None, json_schema_extra={"additionalProperties": _QUANTITY})


class RuntimeOverrides(_Model):
    """Runtime settings a pool may override; every field unset means "inherit from spec.runtime"."""

    image: str | None = Field(None, min_length=1, max_length=1024)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    block_size: int | None = Field(None, ge=1, le=1024)
    max_model_len: int | None = Field(None, ge=1)
    kv_cache_memory: int | str | None = Field(None, description="KV cache bytes, a number or a quantity like 2Gi.",
                                              json_schema_extra=_QUANTITY)
    extra_args: list[str] | None = Field(None, max_length=64, description="Appended to `pdserve serve`.")
    env: list[KubeObject] | None = Field(None, max_length=128, json_schema_extra={"items": _PRESERVE})
    resources: Resources | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[KubeObject] | None = Field(None, max_length=64, json_schema_extra={"items": _PRESERVE})


class RuntimeSpec(RuntimeOverrides):
    image: str | None = Field(DEFAULT_IMAGE, min_length=1, max_length=1024)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = "auto"
    block_size: int | None = Field(16, ge=1, le=1024)
    kv_cache_memory: int | str | None = Field("1Gi", description="KV cache bytes, a number or a quantity like 2Gi.",
                                              json_schema_extra=_QUANTITY)
    api_key_secret_ref: SecretKeyRef | None = Field(None, description="API key runtime pods require (env PDSERVE_API_KEY).")


class PoolSpec(RuntimeOverrides):
    replicas: int = Field(1, ge=0, le=10000)


class RouterSpec(_Model):
    replicas: int = Field(1, ge=0, le=1000)
    policy: Literal["precise-prefix", "round-robin", "least-loaded", "session-affinity"] = "precise-prefix"
    pd_threshold: int = Field(256, ge=0, description="Prompts of at least this many tokens go prefill -> decode.")
    api_key_secret_ref: SecretKeyRef | None = Field(None, description="API key clients must send (--api-key).")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)
    image: str | None = Field(None, min_length=1, max_length=1024, description="Defaults to spec.runtime.image.")
    resources: Resources | None = None


class RedisSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(
        ("has(self.url) != has(self.urlSecretRef)", "redis needs exactly one of url and urlSecretRef")))
    url: str | None = Field(None, max_length=2048, pattern=r"^rediss?://.+")
    url_secret_ref: SecretKeyRef | None = None


class DiskSpec(_Model):
    claim_name: str = Field(min_length=1, max_length=253, description="A ReadWriteMany PVC shared by all pods.")
    path: str = Field("", max_length=1024, pattern=r"^([A-Za-z0-9_][-A-Za-z0-9_.]*)(/[A-Za-z0-9_][-A-Za-z0-9_.]*)*$|^$",
                      description="Directory inside the claim (relative, no `..`).")


class KVTransferSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.connector != 'redis' || has(self.redis)", "connector redis requires redis.url or redis.urlSecretRef"),
        ("self.connector != 'disk' || has(self.disk)", "connector disk requires disk.claimName")))
    connector: Literal["nixl", "redis", "disk"] = "nixl"
    redis: RedisSpec | None = None
    disk: DiskSpec | None = None


class RoleAutoscaling(_Model):
    """Autoscaling of one pool: sized so that the worst observed/target ratio over the window is about 1."""

    # Targets are per replica; latency targets only count windows that had requests (see autoscale_policy.py).

    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
        ("has(self.ttftP90Seconds) || has(self.itlP90Seconds) || has(self.kvCacheUsage) || has(self.queueDepth)"
         " || has(self.promptTokensPerSecond)", "autoscaling needs at least one target")))
    min_replicas: int = Field(1, ge=1, le=10000, description="At least 1: a pool with no pod has no metrics to "
                              "scale up from (scale a pool to 0 by hand, without autoscaling).")
    max_replicas: int = Field(ge=1, le=10000)
    ttft_p90_seconds: float | None = Field(None, gt=0, description="Time-to-first-token p90 target (prefill).")
    itl_p90_seconds: float | None = Field(None, gt=0, description="Inter-token latency p90 target (decode).")
    kv_cache_usage: float | None = Field(None, gt=0, le=1, description="Mean KV-cache usage target, 0-1 (decode).")
    queue_depth: float | None = Field(None, gt=0, description="Mean waiting requests per pod.")
    prompt_tokens_per_second: float | None = Field(
        None, gt=0, description="Uncached prompt tokens per second one replica handles (prefix-cache hits and "
        "prompts the router keeps on decode do not count).")
    scale_up_stabilization_seconds: int = Field(0, ge=0, le=3600, description="Scale up to the lowest recommendation "
                                                "of this window (0: at once).")
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600, description="Scale down only to the highest "
                                                  "recommendation of this window.")
    scale_up_step: int = Field(4, ge=1, le=1000, description="Most replicas added per decision.")
    scale_down_step: int = Field(1, ge=1, le=1000, description="Most replicas removed per decision.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while every ratio is within 1 +- tolerance.")

    @model_validator(mode="after")
    def _check(self) -> RoleAutoscaling:  # the same rules as the CEL above, for specs that bypassed the schema
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be <= maxReplicas")
        if not any((self.ttft_p90_seconds, self.itl_p90_seconds, self.kv_cache_usage, self.queue_depth,
                    self.prompt_tokens_per_second)):
            raise ValueError("autoscaling needs at least one target")
        return self


class AutoscalingSpec(_Model):
    """Per-pool autoscaling by the operator: it writes the replicas of each pool listed here."""

    # decode through the /scale subresource, prefill through spec.prefill.replicas (a CRD has one /scale)

    prefill: RoleAutoscaling | None = None
    decode: RoleAutoscaling | None = Field(None, description="The decode pool (the only pool when monolithic).")
    interval_seconds: int = Field(15, ge=1, le=3600, description="Period of the scrape-and-decide loop.")
    window_seconds: int = Field(60, ge=1, le=3600, description="Metrics window: histogram and counter deltas over "
                                "the last this many seconds (not lifetime averages).")


class InferenceServiceSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(
        ("!has(self.autoscaling) || !has(self.autoscaling.prefill) || has(self.prefill)",
         "autoscaling.prefill requires spec.prefill")))
    model: ModelSpec
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, json_schema_extra=_DEFAULT_EMPTY)
    prefill: PoolSpec | None = Field(None, description="Omit for one pool of `both` pods (no disaggregation).")
    decode: PoolSpec = Field(default_factory=PoolSpec, json_schema_extra=_DEFAULT_EMPTY)
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra=_DEFAULT_EMPTY)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec,
                                        json_schema_extra={"default": {"connector": "nixl"}})  # CEL checks defaults
    autoscaling: AutoscalingSpec | None = None
    loras: list[LoRASpec] | None = Field(None, max_length=64, description="LoRA adapters every runtime pod of both "
                                         "roles serves; names must be unique. Pods start with LoRA enabled (when this "
                                         "field or loraConfig is set, `[]` included) and the operator loads/unloads "
                                         "adapters in running pods through their /v1/load_lora_adapter and "
                                         "/v1/unload_lora_adapter API: a change never rolls the pods, except an "
                                         "adapter on a PVC no other adapter uses (a new volume) or the last one on a "
                                         "claim. status.loras reports per-adapter readiness.")
    lora_config: LoRAConfigSpec | None = Field(None, description="LoRA serving settings (defaults apply when spec.loras "
                                               "is set).")

    @model_validator(mode="after")
    def _autoscaled_pools_exist(self) -> InferenceServiceSpec:
        if self.autoscaling and self.autoscaling.prefill and self.prefill is None:
            raise ValueError("autoscaling.prefill requires spec.prefill")
        names = [lora.name for lora in self.loras or []]
        if len(set(names)) != len(names) or self.model.name in names:
            raise ValueError("spec.loras names must be unique and differ from spec.model.name")
        return self


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class PoolStatus(_Model):
    desired_replicas: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    ready: str = Field("0/0", description="ready/desired, for printer columns")
    selector: str = ""


class LoRAStatus(_Model):
    name: str
    ready_replicas: int = Field(0, description="Ready runtime pods that have the adapter loaded.")
    desired_replicas: int = Field(0, description="Runtime pods of both roles the spec asks for.")
    ready: str = Field("0/0", description="readyReplicas/desiredReplicas")
    message: str = Field("", description="Why the adapter is not loaded somewhere (the pod's answer), if it is not.")


class InferenceServiceStatus(_Model):
    observed_generation: int | None = None
    phase: Literal["Pending", "Progressing", "Ready", "Failed"] | None = None
    conditions: list[Condition] | None = None
    prefill: PoolStatus | None = None
    decode: PoolStatus | None = None
    router: PoolStatus | None = None
    endpoint: str | None = None
    loras: list[LoRAStatus] | None = None
