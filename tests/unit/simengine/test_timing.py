"""The simulated engine's timing model: step costs, KV blocks, prefix caching, preemption, heavy tails.

The scheduler is ticked directly (no clock), so counts and durations are exact; a few tests pace requests
against the wall clock or a `PacedClock`, and one serves the model over HTTP to check what /metrics reports.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx
import pytest

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.engines.metrics import parse_metrics
from durable_rollouts.simengine import PolicyName, SimEngine, SimSettings, TimingSettings
from durable_rollouts.simengine.clock import PacedClock
from durable_rollouts.simengine.policies import heavy_tail_length
from durable_rollouts.simengine.steploop import StepLoop
from durable_rollouts.simengine.timing import Seq, StepScheduler

pytestmark = pytest.mark.timeout(60)

BASE, PER_SEQ, PREFILL = 10.0, 1.0, 0.5


def _sched(blocks: int, block_size: int = 4, max_num_seqs: int = 64, **timing: Any) -> StepScheduler:
    """A scheduler that ticks one step at a time unless ``max_tick_ms`` says otherwise."""
    timing.setdefault("max_tick_ms", 0.0)
    t = TimingSettings(step_base_ms=BASE, step_per_seq_ms=PER_SEQ, prefill_ms_per_token=PREFILL, **timing)
    return StepScheduler(t, blocks, block_size, max_num_seqs)


def _seq(rid: str, prompt: list[int], output_len: int, first: int = 1000) -> Seq:
    output = list(range(first, first + output_len))
    return Seq(request_id=rid, tokens=[*prompt, *output], prompt_len=len(prompt))


def _drain(sched: StepScheduler, limit: int = 10_000) -> list[Seq]:
    """Tick until nothing runs or waits, checking the block invariant; the sequences in finishing order."""
    done: list[Seq] = []
    for _ in range(limit):
        if not sched.has_work():
            return done
        done += sched.tick("v0").finished
        assert all(len(s.blocks) == sched.pool.blocks_for(s.computed) for s in sched.batch)
        assert all(not s.blocks for s in sched.queue)
        held = {b for s in sched.batch for b in s.blocks}
        assert len(held) + sched.pool.free_blocks == sched.pool.num_blocks
    raise AssertionError("the scheduler did not drain")


def test_step_time_is_base_plus_batch_plus_prefill() -> None:
    sched = _sched(blocks=16)
    sched.add(_seq("a", list(range(10)), 5))
    first = sched.tick("v0")
    assert first.steps == 1 and first.duration_s == pytest.approx((BASE + PER_SEQ + PREFILL * 9) / 1000)
    _drain(sched)
    # One prefill step (which samples the first token), then four decode steps of one sequence.
    assert sched.stats.steps == 5
    assert sched.stats.busy_s == pytest.approx((BASE + PER_SEQ + PREFILL * 9 + 4 * (BASE + PER_SEQ)) / 1000)
    assert sched.kv_usage == 0.0 and sched.running == 0


def test_preemption_when_the_pool_is_exhausted_is_counted_and_recomputed() -> None:
    sched = _sched(blocks=8)  # 32 tokens; two sequences of 8 + 12 tokens (5 blocks each) do not fit
    a, b = _seq("a", list(range(8)), 12), _seq("b", list(range(100, 108)), 12, first=2000)
    sched.add(a)
    sched.add(b)
    finished = _drain(sched)
    assert finished == [a, b]
    assert a.preemptions == 0 and b.preemptions >= 1
    assert sched.stats.preemptions == b.preemptions
    assert 0 < sched.stats.recomputed_tokens <= b.high_water
    assert a.generated == a.output_len and b.generated == b.output_len
    assert b.spans == [{"version": "v0", "start": 0, "end": 12}]
    assert sched.kv_usage == 0.0 and sched.pool.free_blocks == 8


def test_requests_wait_for_blocks_and_report_it() -> None:
    sched = _sched(blocks=6)  # 24 tokens: one 16-token prompt fits, a second must wait
    a, b = _seq("a", list(range(16)), 4), _seq("b", list(range(200, 216)), 4, first=2000)
    sched.add(a)
    sched.add(b)
    sched.tick("v0")
    assert (sched.running, sched.waiting) == (1, 1)
    assert sched.kv_usage == pytest.approx(4 / 6)  # 16 prompt tokens computed; the sampled one is not yet
    assert _drain(sched) == [a, b] and sched.stats.preemptions == 0


def test_prefix_cached_prompt_blocks_are_not_prefilled_again() -> None:
    sched = _sched(blocks=32)
    prompt = list(range(10))
    turn1 = _seq("r/0", prompt, 6)
    sched.add(turn1)
    _drain(sched)
    # 15 tokens were computed (the last sampled one never is): 3 full blocks are cached.
    context = [*turn1.tokens, 500, 501, 502, 503, 504]  # 21 tokens
    sched.add(_seq("r/1", context, 3))
    prefill_before = sched.stats.prefill_tokens
    first = sched.tick("v0")
    assert first.duration_s == pytest.approx((BASE + PER_SEQ + PREFILL * (21 - 12 - 1)) / 1000)
    assert sched.stats.prefill_tokens - prefill_before == 21 - 12 - 1
    assert (sched.pool.queries_total, sched.pool.hits_total) == (10 + 21, 12)
    turn2 = _drain(sched)[0]
    # Blocks computed in a turn that itself started from cached blocks are cached too (23 computed: 5 full).
    sched.add(_seq("r/2", [*turn2.tokens, 600, 601, 602], 2))
    sched.tick("v0")
    assert sched.pool.hits_total == 12 + 20
    _drain(sched)
    sched.add(_seq("other", list(range(300, 321)), 3))
    sched.tick("v0")
    assert sched.pool.hits_total == 12 + 20


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = _sched(blocks=64, max_num_batched_tokens=16)
    sched.add(_seq("a", list(range(40)), 2))
    assert [sched.tick("v0").duration_s for _ in range(3)] == pytest.approx(
        [(BASE + PER_SEQ + PREFILL * 15) / 1000] * 2 + [(BASE + PER_SEQ + PREFILL * 7) / 1000]
    )
    assert _drain(sched)[0].generated == 2


def test_fast_forward_gives_the_same_steps_as_one_step_at_a_time() -> None:
    def run(max_tick_ms: float) -> tuple[Any, ...]:
        sched = _sched(blocks=24, max_num_seqs=4, max_tick_ms=max_tick_ms)
        for i in range(10):
            sched.add(
                _seq(f"s{i}", list(range(i * 50, i * 50 + 5 + 3 * i)), 6 + 7 * (i % 4), first=5000 + i * 100)
            )
        order = [s.request_id for s in _drain(sched)]
        st = sched.stats
        return (
            order,
            st.steps,
            round(st.busy_s, 9),
            st.preemptions,
            st.recomputed_tokens,
            st.seq_steps,
            st.ticks,
        )

    one_by_one, fast = run(0.0), run(1000.0)
    assert fast[:-1] == one_by_one[:-1]
    assert fast[-1] < one_by_one[-1] == one_by_one[1]
    assert one_by_one[3] > 0  # the pool is tight enough to preempt


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_finish_every_token_once(seed: int) -> None:
    """Shared prompt prefixes, a tight pool and a small token budget; stepping at once or together agrees."""

    def run(max_tick_ms: float) -> tuple[Any, ...]:
        rng = random.Random(seed)
        sched = _sched(blocks=40, max_num_seqs=6, max_tick_ms=max_tick_ms, max_num_batched_tokens=48)
        seqs = []
        for i in range(14):
            prefix = list(range(1000 * (i % 3), 1000 * (i % 3) + rng.randint(4, 40)))
            prompt = prefix + [rng.randrange(500) for _ in range(rng.randint(1, 30))]
            seqs.append(_seq(f"s{i}", prompt, rng.randint(1, 60), first=10_000 + 100 * i))
            sched.add(seqs[-1])
        order = [s.request_id for s in _drain(sched)]
        assert all(s.generated == s.output_len and s.spans[-1]["end"] == s.output_len for s in seqs)
        st = sched.stats
        return (
            order,
            st.steps,
            round(st.busy_s, 9),
            st.preemptions,
            st.recomputed_tokens,
            sched.pool.hits_total,
        )

    assert run(0.0) == run(500.0)


def test_abort_frees_blocks() -> None:
    sched = _sched(blocks=8)
    a = _seq("a", list(range(12)), 8)
    sched.add(a)
    sched.tick("v0")
    assert sched.kv_usage > 0
    sched.abort(a)
    assert sched.kv_usage == 0.0 and not sched.has_work() and sched.stats.aborted_tokens == 1


async def test_busy_time_counts_only_ticks_against_the_wall_clock() -> None:
    timing = TimingSettings(step_base_ms=100.0, step_per_seq_ms=0.0, prefill_ms_per_token=0.0, time_scale=10)
    loop = StepLoop(StepScheduler(timing, 64, 4, 8), timing, lambda: "v0")
    t0 = asyncio.get_running_loop().time()
    seq = await loop.generate("a", list(range(8)), list(range(100, 110)))
    await asyncio.sleep(0.1)  # idle: not busy
    await loop.generate("b", list(range(8)), list(range(200, 210)))
    elapsed = asyncio.get_running_loop().time() - t0
    await loop.aclose()
    assert seq.generated == 10 and loop.scheduler.stats.busy_s == pytest.approx(2.0)
    assert 0.2 <= loop.busy_wall_s <= elapsed - 0.1  # at least the modelled time; not the idle gap


async def test_paced_clock_stops_while_the_loop_is_stalled() -> None:
    clock = PacedClock(time_scale=10, resolution_s=0.001, max_step_s=0.003)
    woken: list[str] = []

    async def sleeper(name: str, t: float) -> None:
        await clock.sleep_until(t)
        woken.append(name)

    sleepers = [asyncio.create_task(sleeper(n, t)) for n, t in (("late", 0.2), ("early", 0.1))]
    await clock.sleep_until(0.05)
    before = clock.now()
    time.sleep(0.2)  # a stall: the event loop does not run (as when the process gets no CPU)
    await asyncio.sleep(0.002)
    assert clock.now() - before < 10 * 0.2 / 4 and clock.paused_s >= 0.15  # not the 2.0 s a wall clock counts
    await asyncio.gather(*sleepers)
    assert woken == ["early", "late"] and clock.now() >= 0.2
    await clock.aclose()


async def test_step_loop_on_a_paced_clock_answers_after_the_modelled_time() -> None:
    timing = TimingSettings(step_base_ms=20.0, step_per_seq_ms=0.0, prefill_ms_per_token=0.0, time_scale=20)
    clock = PacedClock(time_scale=20)
    loop = StepLoop(StepScheduler(timing, 64, 4, 8), timing, lambda: "v0", clock)
    start = clock.now()
    await loop.generate("a", list(range(8)), list(range(100, 125)))
    assert loop.scheduler.stats.busy_s == pytest.approx(0.5)
    assert clock.now() - start >= 0.5
    await loop.aclose()
    await clock.aclose()


def test_heavy_tail_lengths() -> None:
    settings = SimSettings(
        policy=PolicyName.RANDOM, tasks=None, random_length="heavy_tail", random_median_tokens=100
    )
    lengths = [heavy_tail_length(f"run/g{i // 8}/{i % 8}/0", settings) for i in range(20_000)]
    assert lengths == [heavy_tail_length(f"run/g{i // 8}/{i % 8}/0", settings) for i in range(20_000)]
    assert 90 <= statistics.median(lengths) <= 110
    tail = sum(n >= 500 for n in lengths) / len(lengths)
    assert 0.016 <= tail <= 0.024
    per_rollout = settings.model_copy(update={"random_tail_key": "rollout", "random_length_sigma": 0.0})
    turns = [{heavy_tail_length(f"rollout{i}/{t}", per_rollout) for t in range(4)} for i in range(2_000)]
    assert {len(t) for t in turns} == {1}
    assert 20 <= sum(t == {1000} for t in turns) <= 60 and all(t in ({100}, {1000}) for t in turns)


async def test_served_timing_model_reports_preemptions_and_waits() -> None:
    timing = TimingSettings(step_base_ms=5.0, step_per_seq_ms=0.5, prefill_ms_per_token=0.01, time_scale=50)
    settings = SimSettings(
        policy=PolicyName.RANDOM,
        tasks=None,
        max_model_len=256,
        num_gpu_blocks=16,
        block_size=16,
        random_min_tokens=60,
        random_max_tokens=90,
        timing=timing,
    )
    engine = SimEngine(settings)
    sampling = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, max_tokens=128, seed=1, logprob_mode="processed_logprobs"
    )
    client = EngineClient(timeout_s=20)
    async with engine.serve(port=0) as url:
        assert engine.steps is not None
        prompts = [[(7 * i + j) % 250 for j in range(60)] for i in range(8)]
        calls = [
            asyncio.create_task(client.generate(url, "tiny", p, sampling, 128, f"r{i}/0"))
            for i, p in enumerate(prompts)
        ]
        async with asyncio.timeout(10):
            while not (engine.steps.scheduler.running and engine.steps.scheduler.waiting):
                await asyncio.sleep(0.001)
        waiting = parse_metrics(engine.metrics_text(), url=url, engine_id="e0", at=0.0)
        assert waiting.waiting_capacity > 0 and waiting.kv_usage > 0
        gens = await asyncio.gather(*calls)
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{url}/metrics")).text
    await client.aclose()
    assert all(g.token_ids[-1] == engine.tokenizer.eos_id and 61 <= len(g.token_ids) <= 91 for g in gens)
    reading = parse_metrics(text, url=url, engine_id="e0", at=1.0)
    stats = engine.steps.scheduler.stats
    assert reading.preemptions_total == stats.preemptions > 0
    assert reading.kv_usage == 0.0 and reading.kv_capacity_tokens == 256
    assert "simengine:recomputed_tokens_total" in text and stats.recomputed_tokens > 0


def test_timing_needs_a_pool_that_holds_one_full_context() -> None:
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        SimSettings(
            policy=PolicyName.RANDOM, tasks=None, num_gpu_blocks=4, block_size=16, timing=TimingSettings()
        )
