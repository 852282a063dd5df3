"""Fast checks without the model: CLI flags -> engine config, request validation, metrics exposition."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.runtime.cli import engine_options, parse_bytes, server_options
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import EngineStats
from pdserve.runtime.metrics import ServerMetrics, parse_samples
from pdserve.runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse

FLAGS = ["--model", "--host", "--port", "--role", "--served-model-name", "--api-key", "--block-size",
         "--num-gpu-blocks", "--kv-cache-memory", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
         "--dtype", "--attention-backend", "--enable-prefix-caching", "--no-enable-prefix-caching",
         "--scheduling-policy", "--max-waiting", "--kv-connector", "--kv-connector-config",
         "--kv-load-failure-policy", "--kv-events-port", "--kv-events-replay-port", "--kv-events-host",
         "--shutdown-grace-period", "--seed", "--log-level"]


def test_serve_help_lists_every_flag_without_importing_torch():
    code = ("import sys; from pdserve.cli import main\n"
            "try: main(['serve', '--help'])\nexcept SystemExit as e: assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'serve --help imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout, flag
    top = subprocess.run([sys.executable, "-m", "pdserve", "--help"], capture_output=True, text=True, timeout=60)
    assert "serve" in top.stdout


@pytest.mark.parametrize("text,value", [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9),
                                        ("1.5GB", 1_500_000_000), ("4096", 4096)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "2XB", "-1", "0", "GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_flags_reach_the_engine_config():
    argv = ["serve", "--role", "prefill", "--block-size", "32", "--kv-cache-memory", "1GiB", "--max-num-seqs", "8",
            "--scheduling-policy", "priority", "--max-waiting", "5", "--no-enable-prefix-caching",
            "--kv-connector", "redis", "--kv-connector-config", '{"url": "redis://127.0.0.1:1"}',
            "--kv-load-failure-policy", "fail", "--max-model-len", "256", "--served-model-name", "m"]
    args = build_parser(argv).parse_args(argv)
    cfg = EngineConfig.from_options(**engine_options(args))
    assert cfg.cache.block_size == 32 and cfg.cache.kv_cache_memory_bytes == 2**30
    assert not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 8 and cfg.scheduler.policy == "priority"
    assert server_options(args).max_waiting == 5
    assert cfg.kv_transfer.connector == "redis" and cfg.kv_transfer.role == "prefill"
    assert cfg.kv_transfer.config == {"url": "redis://127.0.0.1:1"} and cfg.kv_transfer.load_failure_policy == "fail"
    assert cfg.model.max_model_len == 256 and cfg.model.served_model_name == "m"


def test_bad_flag_values_exit_2():
    for argv in (["serve", "--kv-connector-config", "[1]"], ["serve", "--port", "70000"], ["serve", "--role", "x"]):
        with pytest.raises(SystemExit) as e:
            build_parser(argv).parse_args(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p"),
    (CompletionRequest, {"prompt": "x", "stop": [""]}, "stop"),
    (CompletionRequest, {"prompt": "x", "echo": True}, None),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, None),
])
def test_protocol_rejects(model, body, param):
    with pytest.raises(ApiError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_protocol_accepts_openai_extras():
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}]}],
                                        "user": "u", "metadata": {"k": "v"}, "stream": True,
                                        "stream_options": {"include_usage": True}})
    assert req.message_dicts() == [{"role": "user", "content": "ab"}] and req.wants_usage_chunk()
    assert parse(CompletionRequest, {"prompt": ["only one"]}).single_prompt() == "only one"
    with pytest.raises(ApiError):
        parse(CompletionRequest, {"prompt": ["a", "b"]}).single_prompt()


def test_metrics_exposition_from_engine_stats():
    m = ServerMetrics("m")
    m.set_engine_stats(EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=10,
                                   prefix_cache_hits=4, num_preemptions=1, prompt_tokens=7, generation_tokens=9,
                                   kv_load_failures=2, recomputed_tokens=16))
    m.observe_step(3)
    m.observe_step(1)
    m.rejected("queue_full")
    s = parse_samples(m.render().decode())
    label = '{model_name="m"}'
    assert s[f"vllm:num_requests_running{label}"] == 3 and s[f"vllm:num_requests_waiting{label}"] == 2
    assert s[f"vllm:kv_cache_usage_perc{label}"] == 0.25 and s[f"vllm:prefix_cache_hits_total{label}"] == 4
    assert s[f"vllm:prompt_tokens_total{label}"] == 7 and s[f"vllm:generation_tokens_total{label}"] == 9
    assert s[f"pdserve:kv_load_failures_total{label}"] == 2 and s[f"pdserve:recomputed_tokens_total{label}"] == 16
    assert s[f"pdserve:max_batch_size{label}"] == 3 and s[f"pdserve:batch_size_count{label}"] == 2
    assert s['pdserve:requests_rejected_total{model_name="m",reason="queue_full"}'] == 1
    # a second server's registry is independent (no global state)
    assert "pdserve:max_batch_size{model_name=\"m\"} 0.0" in ServerMetrics("m").render().decode()
