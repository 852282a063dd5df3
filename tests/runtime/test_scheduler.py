"""Scheduler scenarios with hand-computed expectations: chunked prefill, continuous batching, max_num_seqs, preemption
by recompute (who, when, and that the redo hits the cache), a cached block's leading tokens copied, priority policy,
aborts (CPU only, no model)."""

from __future__ import annotations

from pdserve.runtime.config import CacheConfig, SchedulerConfig
from pdserve.runtime.request import Request, RequestStatus
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sched_output import ModelRunnerOutput
from pdserve.runtime.scheduler import Scheduler

BS = 4
TOKEN = 7


def make(num_blocks=16, budget=16, max_seqs=8, policy="fcfs", chunked=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=BS), num_blocks, max_model_len=64)


def add(s: Scheduler, rid: str, n: int, max_tokens=8, priority=0, arrival=0.0, base=0) -> Request:
    r = Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens), block_size=BS,
                priority=priority, arrival_time=arrival)
    s.add_request(r)
    return r


def step(s: Scheduler):
    """Run one step with a fake model that always samples TOKEN; returns [(id, num tokens, start)] and the output."""
    out = s.schedule()
    starts = out.num_computed_tokens()
    sched = [(rid, n, starts[rid]) for rid, n in out.num_scheduled_tokens.items()]
    sampled = [rid for rid, n, start in sched if start + n == s.requests[rid].num_tokens]
    s.update_from_output(out, ModelRunnerOutput(sampled, [[TOKEN] for _ in sampled], [None for _ in sampled]))
    return sched, out


def test_chunked_prefill_and_continuous_batching():
    s = make(budget=8)
    a = add(s, "a", 10)
    assert step(s)[0] == [("a", 8, 0)]                         # first chunk, no sample
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 0
    add(s, "b", 5, base=100)
    assert step(s)[0] == [("a", 2, 8), ("b", 5, 0)]            # a finishes its prompt, b joins with the rest budget
    assert a.output_token_ids == [TOKEN] and s.requests["b"].output_token_ids == [TOKEN]
    assert step(s)[0] == [("a", 1, 10), ("b", 1, 5)]           # both decode
    assert s.prompt_tokens == 15 and s.generation_tokens == 4


def test_no_chunking_waits_for_budget():
    s = make(budget=8, chunked=False)
    add(s, "a", 6)
    add(s, "b", 6, base=50)
    assert step(s)[0] == [("a", 6, 0)]                         # b (6) does not fit in the remaining 2
    assert step(s)[0] == [("a", 1, 6), ("b", 6, 0)]


def test_max_num_seqs():
    s = make(max_seqs=1)
    add(s, "a", 3, max_tokens=2)
    add(s, "b", 3, base=50)
    assert step(s)[0] == [("a", 3, 0)]
    assert step(s)[0] == [("a", 1, 3)]                         # a reaches max_tokens=2 and finishes
    assert s.running == [] and list(s.waiting)[0].request_id == "b"
    assert step(s)[0] == [("b", 3, 0)]


def test_preempt_latest_and_recompute_with_prefix_hit():
    s = make(num_blocks=4, budget=32)
    a, b = add(s, "a", 7, max_tokens=4), add(s, "b", 7, base=100)
    step(s)                                                    # a: blocks 0,1  b: blocks 2,3 ; 8 tokens each
    assert s.kv.get_block_ids("a") == [0, 1] and s.kv.get_block_ids("b") == [2, 3]
    step(s)                                                    # decode position 7: still in the second block
    sched, out = step(s)                                       # position 8 needs a third block: none free
    assert out.preempted_req_ids == ["b"] and sched == [("a", 1, 8)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.num_preemptions == 1
    # b's blocks were freed tail first (3, 2); a took block 3, evicting b's second block hash.
    assert s.kv.get_block_ids("a") == [0, 1, 3] and s.waiting[0] is b
    assert s.kv.pool.get_cached_block(b.all_block_hashes[0]).block_id == 2
    assert step(s)[0] == [("a", 1, 9)]                         # b needs 3 blocks (1 hit + 2), 1 free: waits
    assert a.status == RequestStatus.FINISHED_LENGTH           # a's 4th token: done, blocks freed
    sched, _ = step(s)                                         # b resumes: its first block is a prefix hit
    assert sched == [("b", 5, 4)] and s.kv.get_block_ids("b")[0] == 2
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (7 + 7 + 9, 4)   # failed lookups not counted
    assert b.output_token_ids == [TOKEN] * 3                   # its earlier outputs were kept, one more sampled


def test_a_cached_blocks_leading_tokens_are_copied_not_recomputed():
    s = make(num_blocks=8, budget=32)
    add(s, "a", 10, max_tokens=1)                              # tokens 0-9: blocks 0 [0-3], 1 [4-7] cached; 2 [8 9]
    step(s)
    b = Request("b", [0, 1, 2, 3, 4, 5, 90, 91, 92, 93, 94], SamplingParams(max_tokens=1), block_size=BS)
    s.add_request(b)
    out = s.schedule()                                         # block 0 a hit; 4, 5 of block 1 copied; 5 computed
    assert out.num_scheduled_tokens == {"b": 5} and out.scheduled_new_reqs[0].num_computed_tokens == 6
    table = out.scheduled_new_reqs[0].block_ids
    assert table[0] == 0 and out.kv_block_copies == [(1, table[1], 2)]
    assert (s.kv.prefix_cache_hits, s.kv.partial_block_hits) == (6, 2)
    assert b.num_cached_tokens == 4                            # reported: whole blocks only (README, side channel)
    assert s.kv.pool.blocks[1].ref_cnt == 1                    # the source: held until the step's output is back
    s.update_from_output(out, ModelRunnerOutput(["b"], [[TOKEN]], [None]))
    assert s.kv.pool.blocks[1].ref_cnt == 0 and s.schedule().kv_block_copies == []


def test_priority_policy_admits_and_preempts_by_priority():
    s = make(num_blocks=4, budget=32, policy="priority")
    lo = add(s, "lo", 7, priority=5, arrival=0.0)
    hi = add(s, "hi", 7, priority=0, arrival=1.0, base=100)
    assert [x[0] for x in step(s)[0]] == ["hi", "lo"]          # lower value first, despite arriving later
    step(s)
    _, out = step(s)
    assert out.preempted_req_ids == ["lo"] and hi.status == RequestStatus.RUNNING


def test_abort_frees_blocks_at_once():
    s = make(num_blocks=8)
    add(s, "a", 9)
    add(s, "b", 3, base=50)
    step(s)
    assert s.kv.pool.get_num_free_blocks() == 8 - 3 - 1
    s.abort_requests(["a", "nope"])
    assert s.kv.pool.get_num_free_blocks() == 8 - 1 and "a" not in s.requests
    assert [x[0] for x in step(s)[0]] == ["b"]
    s.abort_requests(["b"])
    assert s.kv.pool.get_num_free_blocks() == 8 and not s.has_unfinished_requests()


def test_stop_token_and_min_tokens():
    s = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=[TOKEN], min_tokens=2), block_size=BS)
    s.add_request(r)
    step(s)
    assert not r.is_finished                                  # min_tokens=2 keeps it going
    step(s)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == TOKEN and r.num_output_tokens == 2


def test_request_never_outgrows_the_pool():
    s = make(num_blocks=2)                                     # 8 token slots in all
    r = add(s, "a", 3, max_tokens=100)
    for _ in range(5):
        step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 8 and s.kv.pool.get_num_free_blocks() == 2
