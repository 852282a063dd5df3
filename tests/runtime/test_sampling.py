"""Sampler, SamplingParams validation and incremental detokenization (CPU, no model weights)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.input_batch import CachedRequestState, build_sampling_metadata
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sampling_params import SamplingParams

V = 8
_sampler = Sampler(torch.device("cpu"))


def sampler(logits, rows: list[CachedRequestState]):
    return _sampler(logits, build_sampling_metadata(rows, torch.device("cpu")))


def req(prompt=(1, 2), out=(), eos=None, **sp) -> CachedRequestState:
    return CachedRequestState("r", list(prompt) + list(out), len(prompt), SamplingParams(**sp), eos_token_id=eos)


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


def draws(probs, n=300, **sp) -> set[int]:
    reqs = [req(**sp) for _ in range(n)]
    return {t.token_id for t in sampler(logits_of(probs).expand(n, -1).clone(), reqs)}


def test_greedy_is_argmax():
    x = torch.randn(3, V)
    assert [t.token_id for t in sampler(x, [req(temperature=0.0) for _ in range(3)])] == x.argmax(-1).tolist()


def test_seed_is_reproducible_per_request():
    flat = torch.zeros(1, 1000)
    def seq(seed):
        r = req(seed=seed)
        return [sampler(flat.clone(), [r])[0].token_id for _ in range(10)]
    assert seq(7) == seq(7) and seq(7) != seq(8)


@pytest.mark.parametrize("sp,allowed", [
    (dict(top_k=1), {0}),
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.6), {0, 1}),       # 0.5 < 0.6: token 1 is needed to reach the mass, token 2 is not
    (dict(top_p=0.4), {0}),
    (dict(min_p=0.5), {0, 1}),       # threshold 0.25: drops 0.2
    (dict(), {0, 1, 2}),
])
def test_filters(sp, allowed):
    assert draws([0.5, 0.3, 0.2], **sp) == allowed


def test_top_p_below_float32_keeps_the_top_token():
    """A top_p that is 0.0 in float32 (1e-151 passes validation) keeps the most likely token; masking every token
    gave NaN probabilities and token 0 whatever the logits (and a grammar's refusal, a 503, under structured outputs)."""
    assert draws([0.2, 0.5, 0.3], n=50, top_p=1e-151) == {1}


def test_low_temperature_concentrates():
    assert draws([0.4, 0.35, 0.25], temperature=0.01) == {0}


def test_penalties():
    x = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    assert sampler(x.clone(), [req(prompt=(0,), temperature=0.0, repetition_penalty=1.2)])[0].token_id == 1
    assert sampler(x.clone(), [req(out=(0,), temperature=0.0, presence_penalty=0.2)])[0].token_id == 1
    assert sampler(x.clone(), [req(out=(0,), temperature=0.0, frequency_penalty=0.05)])[0].token_id == 0
    assert sampler(x.clone(), [req(out=(0, 0, 0), temperature=0.0, frequency_penalty=0.05)])[0].token_id == 1


def test_min_tokens_masks_eos_and_stop_ids():
    x = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    r = req(eos=0, temperature=0.0, min_tokens=1, stop_token_ids=[1])
    assert sampler(x.clone(), [r])[0].token_id == 2
    r.token_ids.append(2)
    assert sampler(x.clone(), [r])[0].token_id == 0


def test_logprobs_top_k_from_raw_distribution():
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    t = sampler(x.clone(), [req(temperature=0.0, logprobs=2)])[0]
    lp = x.log_softmax(-1)[0]
    assert t.token_id == 0 and set(t.logprobs) == {0, 2}
    assert math.isclose(t.logprob, lp[0].item(), rel_tol=1e-6) and math.isclose(t.logprobs[2], lp[2].item(), rel_tol=1e-6)
    t = sampler(x.clone(), [req(temperature=0.0, logprobs=0)])[0]
    assert set(t.logprobs) == {0}


@pytest.mark.parametrize("kw,field", [
    (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_normalizes():
    sp = SamplingParams(stop="###", top_k=0)
    assert sp.stop_strings == ("###",) and sp.top_k == -1 and sp.stop_token_ids == []


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.runtime.model_loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None))


TEXTS = ["Hello, world! How are you today?", "naïve café — déjà vu 🍕🚀 日本語のテキスト",
         "  leading spaces\n\n\ttabs and  double  spaces ", "def f(x):\n    return x ** 2  # square",
         "<|im_start|>user\nhi<|im_end|>", "émojis: 👨‍👩‍👧‍👦 and accents ÀÉÎÕÜ"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenization_equals_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    seen = []
    for t in ids:
        d.update([t])
        cur = d.output_text(finished=False)
        assert cur.startswith("".join(seen[-1:]) if seen else "")      # text only grows
        seen.append(cur)
    d.flush()
    assert d.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_string_cut_and_held_back(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, stop=("END",))
    streamed, stop = [], None
    for t in ids:
        stop = d.update([t])
        streamed.append(d.output_text(finished=stop is not None))
        if stop:
            break
    assert stop == "END" and d.text == "The answer is 42. "
    assert all(not s.rstrip().endswith(("E", "EN", "END")) for s in streamed)   # never streamed, then cut
    d2 = IncrementalDetokenizer(tokenizer, stop=("END",), include_stop_str_in_output=True)
    for t in ids:
        if d2.update([t]):
            break
    assert d2.text == "The answer is 42. END"
