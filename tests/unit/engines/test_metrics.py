"""The vLLM /metrics parser on a recorded exposition and on broken ones."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from durable_rollouts.engines.metrics import fetch_reading, parse_metrics

SAMPLE = (Path(__file__).parents[1] / "data" / "vllm_metrics_sample.txt").read_text()
URL = "http://127.0.0.1:8000"


def parse(text: str):
    return parse_metrics(text, url=URL, engine_id="e0", at=12.5)


def without(text: str, metric: str) -> str:
    """The exposition minus every line that mentions ``metric``."""
    return "".join(line for line in text.splitlines(keepends=True) if metric not in line)


def two_engines() -> str:
    """A data-parallel server: each series once per ``engine`` label."""
    lines = []
    for line in SAMPLE.splitlines():
        lines.append(line)
        if not line.startswith("#"):
            second = line.replace('engine="0"', 'engine="1"')
            if "cache_config_info" not in line:
                name_labels, value = second.rsplit(" ", 1)
                second = f"{name_labels} {float(value) * 2 if 'kv_cache_usage' not in line else 0.9}"
            lines.append(second)
    return "\n".join(lines) + "\n"


def assert_one_line_error(text: str, *needles: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(text)
    message = str(info.value)
    assert "\n" not in message
    for needle in (URL, *needles):
        assert needle in message


def test_parses_recorded_sample():
    r = parse(SAMPLE)
    assert (r.engine_id, r.at) == ("e0", 12.5)
    assert r.kv_usage == 0.4375
    assert (r.running, r.waiting_capacity) == (3, 2)
    assert r.preemptions_total == 1.0  # the counter family is "vllm:num_preemptions", its sample "_total"
    assert r.kv_capacity_tokens == 65_536  # kv_cache_size_tokens label


def test_sums_counts_and_capacity_across_engine_label_sets():
    r = parse(two_engines())
    assert r.kv_usage == 0.9  # the fuller rank decides
    assert (r.running, r.waiting_capacity, r.preemptions_total) == (3 + 6, 2 + 4, 1.0 + 2.0)
    assert r.kv_capacity_tokens == 2 * 65_536


def test_waiting_falls_back_to_num_requests_waiting():
    text = without(SAMPLE, "vllm:num_requests_waiting_by_reason").replace(
        'vllm:num_requests_waiting{engine="0",model_name="/models/tiny-llama"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="/models/tiny-llama"} 7.0',
    )
    assert parse(text).waiting_capacity == 7


def test_deferred_requests_are_not_capacity_waiting():
    text = SAMPLE.replace('reason="deferred"} 0.0', 'reason="deferred"} 5.0')
    assert parse(text).waiting_capacity == 2


def test_accepts_older_gpu_cache_usage_name():
    text = SAMPLE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse(text).kv_usage == 0.4375


def test_capacity_from_blocks_when_size_label_is_unset():
    text = SAMPLE.replace('kv_cache_size_tokens="65536"', 'kv_cache_size_tokens="None"').replace(
        'num_gpu_blocks="512"', 'num_gpu_blocks="100"'
    )
    assert parse(text).kv_capacity_tokens == 100 * 128


def test_untyped_counter_sample_is_found():
    text = without(SAMPLE, "vllm:num_preemptions") + "vllm:num_preemptions_total 4\n"
    assert parse(text).preemptions_total == 4.0


@pytest.mark.parametrize(
    ("metric", "reported"),
    [
        ("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("vllm:num_requests_running", "vllm:num_requests_running"),
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting"),
        ("vllm:num_preemptions", "vllm:num_preemptions_total"),
        ("vllm:cache_config_info", "vllm:cache_config_info"),
    ],
)
def test_missing_metric_is_named(metric, reported):
    assert_one_line_error(without(SAMPLE, metric), reported)


@pytest.mark.parametrize("text", ["", "\n", "# HELP x nothing\n# TYPE x gauge\n"])
def test_empty_exposition_is_an_error(text):
    assert_one_line_error(text, "vllm:kv_cache_usage_perc")


def test_malformed_exposition_is_one_line():
    assert_one_line_error(SAMPLE + 'vllm:num_requests_running{engine="0" 3\nnot a metric line at all\n')


def test_out_of_range_values_are_rejected():
    assert_one_line_error(SAMPLE.replace("} 0.4375", "} 1.5"), "kv_usage")
    assert_one_line_error(SAMPLE.replace("} 3.0", "} NaN"), "vllm:num_requests_running")


def test_cache_info_without_capacity_labels_is_rejected():
    text = SAMPLE.replace('kv_cache_size_tokens="65536"', 'kv_cache_size_tokens="None"').replace(
        'num_gpu_blocks="512"', 'num_gpu_blocks="None"'
    )
    assert_one_line_error(text, "vllm:cache_config_info", "num_gpu_blocks")


async def test_fetch_reading_gets_and_parses_metrics():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text=SAMPLE)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await fetch_reading(client, URL + "/", "e7", now=3.0)
    assert seen == [URL + "/metrics"]
    assert (r.engine_id, r.at, r.kv_capacity_tokens) == ("e7", 3.0, 65_536)


async def test_fetch_reading_raises_on_http_error():
    transport = httpx.MockTransport(lambda request: httpx.Response(503, text="down"))
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.HTTPStatusError):
            await fetch_reading(client, URL, "e0", now=0.0)
