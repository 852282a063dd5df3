"""One stop path: token stops and stop strings decided per new token by the scheduler's StopChecker (real tokenizer,
no model). Several tokens accepted in one step (speculative decoding) stop at the first one that stops the request."""

from __future__ import annotations

import pytest

from pdserve.runtime.config import CacheConfig, SchedulerConfig
from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.request import Request, RequestStatus
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sched_output import ModelRunnerOutput
from pdserve.runtime.scheduler import Scheduler

BS = 4
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.runtime.model_loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None))


def run(tokenizer, sp: SamplingParams, tokens: list[int]) -> tuple[Request, IncrementalDetokenizer]:
    """Prefill a 3-token prompt, then feed ``tokens`` as ONE step's accepted tokens."""
    detoks: dict[str, IncrementalDetokenizer] = {}
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS), 16, max_model_len=64, detokenizers=detoks)
    req = Request("r", [10, 11, 12], sp, block_size=BS, eos_token_id=EOS)
    detoks["r"] = IncrementalDetokenizer(tokenizer, sp.skip_special_tokens, sp.stop_strings,
                                         sp.include_stop_str_in_output)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["r"], [tokens], [None]))
    return req, detoks["r"]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_stop_token_drops_the_rest_of_the_step(tokenizer):
    a, b = ids(tokenizer, " hello")[0], ids(tokenizer, " world")[0]
    req, detok = run(tokenizer, SamplingParams(max_tokens=10, stop_token_ids=[b]), [a, b, a, a])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == b
    assert req.output_token_ids == [a, b]                       # tokens after the stop are not kept
    assert detok.text == " hello"                               # the stop token's text is dropped


def test_stop_string_inside_a_step(tokenizer):
    toks = ids(tokenizer, " one two END three four")
    req, detok = run(tokenizer, SamplingParams(max_tokens=20, stop="END"), toks)
    end = next(i for i in range(len(toks)) if "END" in tokenizer.decode(toks[:i + 1]))
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == "END"
    assert req.output_token_ids == toks[:end + 1] and detok.text == " one two "


def test_min_tokens_then_eos_and_length(tokenizer):
    a = ids(tokenizer, " hi")[0]
    req, _ = run(tokenizer, SamplingParams(max_tokens=10, min_tokens=2), [EOS, EOS, a])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [EOS, EOS]   # 1st EOS too early
    req, detok = run(tokenizer, SamplingParams(max_tokens=2, ignore_eos=True), [EOS, a, a])
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [EOS, a]
    assert detok.text == " hi"                                   # flushed at finish
