"""The simulated engine's ``GET /metrics``: Prometheus text with vLLM 0.32's names, types and labels.

Invariant: the exposition always carries every series `engines.metrics.parse_metrics` needs
(KV usage, running, waiting and waiting by reason, preemptions, cache config), read from the one
scheduler and prefix cache the server admits requests through (`Scheduler` and `PrefixCache`, or the timing
model's `StepScheduler` and `BlockPool`), so what the admission controller reads is what the engine is
doing. With the timing model it adds ``simengine:`` series vLLM does not have (busy time, recomputed tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Load(Protocol):
    """What runs and waits, and how full the KV cache is."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...


class PrefixCounts(Protocol):
    queries_total: int
    hits_total: int


@dataclass
class Counters:
    """Monotonic request and token counts."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})


@dataclass(frozen=True)
class EngineView:
    """What the exposition is rendered from."""

    model: str
    scheduler: Load
    prefix: PrefixCounts
    counters: Counters
    num_gpu_blocks: int
    block_size: int
    preemptions: int = 0
    timing: TimingView | None = None


@dataclass(frozen=True)
class TimingView:
    """The timing model's own counters (no vLLM equivalent)."""

    busy_wall_s: float
    busy_sim_s: float
    recomputed_tokens: int


def render_metrics(view: EngineView) -> str:
    """The Prometheus text exposition of one engine (data-parallel rank ``engine="0"``)."""
    base = f'engine="0",model_name="{_escape(view.model)}"'
    s, c = view.scheduler, view.counters
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        suffix = "_total" if kind == "counter" else ""
        lines.extend(f"{name}{suffix}{{{labels}}} {float(value)!r}" for labels, value in samples)

    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [(base, s.running)],
    )
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [(base, s.waiting)],
    )
    family(
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of waiting requests by reason.",
        [(f'{base},reason="capacity"', s.waiting), (f'{base},reason="deferred"', 0)],
    )
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [(base, s.kv_usage)],
    )
    family(
        "vllm:num_preemptions",
        "counter",
        "Cumulative number of preemption from the engine.",
        [(base, view.preemptions)],
    )
    family(
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(base, view.prefix.queries_total)],
    )
    family(
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(base, view.prefix.hits_total)],
    )
    family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", [(base, c.prompt_tokens)])
    family(
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
        [(base, c.generation_tokens)],
    )
    family(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        [(f'{base},finished_reason="{reason}"', n) for reason, n in c.finished.items()],
    )
    blocks, size = view.num_gpu_blocks, view.block_size
    cache = (
        f'block_size="{size}",enable_prefix_caching="True",engine="0",'
        f'kv_cache_size_tokens="{blocks * size}",num_gpu_blocks="{blocks}"'
    )
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(cache, 1)])
    if view.timing is not None:
        t = view.timing
        family(
            "simengine:busy_wall_seconds",
            "counter",
            "Wall seconds with a running batch.",
            [(base, t.busy_wall_s)],
        )
        family("simengine:busy_sim_seconds", "counter", "Simulated seconds of steps.", [(base, t.busy_sim_s)])
        family(
            "simengine:recomputed_tokens",
            "counter",
            "Tokens computed again after a preemption.",
            [(base, t.recomputed_tokens)],
        )
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
