"""Read one vLLM engine's Prometheus ``/metrics`` into an `EngineReading` for the admission controller.

Invariant: a reading is built only from a complete exposition. Every series the controller needs is present
and in range, or parsing fails with a one-line `ValueError` naming the engine URL and the missing metric, so a
half-read engine never looks healthy (the caller keeps its previous reading, which then ages out).

Series read (vLLM 0.32 names; each may carry ``model_name``/``engine`` labels, one set per data-parallel
rank):

- ``vllm:kv_cache_usage_perc`` (gauge, 0-1; ``vllm:gpu_cache_usage_perc`` in older vLLM): the worst rank;
- ``vllm:num_requests_running``: summed;
- ``vllm:num_requests_waiting_by_reason{reason="capacity"}``, else ``vllm:num_requests_waiting``: summed;
- ``vllm:num_preemptions_total`` (counter): summed;
- ``vllm:generation_tokens_total`` (counter, optional: 0 when absent): summed;
- ``vllm:cache_config_info`` labels: ``kv_cache_size_tokens``, else ``num_gpu_blocks`` × ``block_size``,
  summed over ranks.

Samples are looked up by sample name, not family name: prometheus_client strips ``_total`` from counter
family names but not from their samples.
"""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from pydantic import ValidationError

from durable_rollouts.contracts.types import EngineReading

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = "vllm:num_requests_running"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_INFO = "vllm:cache_config_info"


def parse_metrics(text: str, *, url: str, engine_id: str, at: float) -> EngineReading:
    """Parse a Prometheus text exposition from one engine.

    Args:
        text: The body of ``GET {url}/metrics``.
        url: The engine's base URL (only for error messages).
        engine_id: Id the reading is filed under.
        at: When the exposition was fetched (the controller's clock).

    Raises:
        ValueError: One line naming ``url`` and what is missing, malformed or out of range.
    """
    samples = _index(text, url)

    def need(*names: str) -> list[Sample]:
        for name in names:
            if samples.get(name):
                return samples[name]
        raise ValueError(f"engine {url}: metric {names[0]} missing from /metrics")

    capacity_waiting = [s for s in samples.get(WAITING_BY_REASON, []) if s.labels.get("reason") == "capacity"]
    try:
        return EngineReading(
            engine_id=engine_id,
            at=at,
            kv_usage=max(s.value for s in need(*KV_USAGE)),
            running=_count(need(RUNNING), url),
            waiting_capacity=_count(capacity_waiting or need(WAITING), url),
            preemptions_total=sum(s.value for s in need(PREEMPTIONS)),
            kv_capacity_tokens=sum(_kv_tokens(s, url) for s in need(CACHE_INFO)),
            generation_tokens_total=sum(s.value for s in samples.get(GENERATION_TOKENS, [])),
        )
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"engine {url}: /metrics gives {field}={err['input']!r}: {err['msg']}") from None


async def fetch_reading(
    client: httpx.AsyncClient, base_url: str, engine_id: str, now: float
) -> EngineReading:
    """GET ``{base_url}/metrics`` and parse it; ``now`` stamps the reading.

    Raises:
        httpx.HTTPError: The engine did not answer or answered with an error status.
        ValueError: The exposition lacks a series the controller needs (see `parse_metrics`).
    """
    url = base_url.rstrip("/")
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text, url=url, engine_id=engine_id, at=now)


def _index(text: str, url: str) -> dict[str, list[Sample]]:
    by_name: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                by_name.setdefault(sample.name, []).append(sample)
    except ValueError as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"engine {url}: malformed /metrics: {detail[:200]}") from None
    if not by_name:
        raise ValueError(f"engine {url}: empty /metrics (metric {KV_USAGE[0]} missing)")
    return by_name


def _count(samples: list[Sample], url: str) -> int:
    """Sum of a gauge that counts requests, as an int."""
    total = sum(s.value for s in samples)
    if not math.isfinite(total):
        raise ValueError(f"engine {url}: metric {samples[0].name} is {total}")
    return round(total)


def _kv_tokens(sample: Sample, url: str) -> int:
    """KV capacity in tokens of one ``cache_config_info`` label set (one engine rank)."""
    labels = sample.labels
    size = _int_label(labels, "kv_cache_size_tokens")
    if size is not None:
        return size
    blocks, block_size = _int_label(labels, "num_gpu_blocks"), _int_label(labels, "block_size")
    if blocks is None or block_size is None:
        raise ValueError(
            f"engine {url}: metric {CACHE_INFO} lacks kv_cache_size_tokens and num_gpu_blocks × block_size"
        )
    return blocks * block_size


def _int_label(labels: dict[str, str], name: str) -> int | None:
    """A label's integer value; None when absent or not a number (vLLM writes unset values as "None")."""
    try:
        return int(labels[name])
    except (KeyError, ValueError):
        return None
