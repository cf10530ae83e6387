"""Engine HTTP replies are classified once: retryable, non-retryable, or context length (truncation)."""

from __future__ import annotations

import httpx
import pytest

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.errors import ContextLengthExceeded, EngineBadReply, EngineBadRequest, EngineUnavailable

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=1, logprob_mode="processed"
)
MODELS = {"data": [{"id": "tiny", "max_model_len": 32}]}


def client_with(handler) -> EngineClient:
    c = EngineClient()
    c._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return c


def reply(status: int, body: object | None = None, text: str | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if text is not None:
            return httpx.Response(status, text=text)
        return httpx.Response(status, json=body)

    return handler


async def generate(c: EngineClient, prompt: list[int] | None = None):
    return await c.generate("http://e", "tiny", prompt or [1, 2, 3], SAMPLING, 4, "r/g/0/0/1")


GOOD = {
    "choices": [
        {
            "token_ids": [5, 6],
            "finish_reason": "stop",
            "logprobs": {"content": [{"token_id": 5, "logprob": -0.1}, {"token_id": 6, "logprob": -0.2}]},
            "weight_versions": [
                {"version": "v1", "start": 0, "end": 1},
                {"version": "v2", "start": 1, "end": 2},
            ],
        }
    ]
}


async def test_good_reply_parses_tokens_logprobs_and_version_spans() -> None:
    gen = await generate(client_with(reply(200, GOOD)))
    assert gen.token_ids == [5, 6] and gen.logprobs == [-0.1, -0.2]
    assert gen.policy_versions == ["v1", "v2"] and gen.finish_reason == "stop"


@pytest.mark.parametrize(
    ("status", "body", "text", "error"),
    [
        (503, {"error": "overloaded"}, None, EngineUnavailable),
        (500, None, "boom", EngineUnavailable),
        (400, {"error": {"message": "temperature must be positive"}}, None, EngineBadRequest),
        (
            400,
            {"error": {"message": "This model's maximum context length is 32 tokens"}},
            None,
            ContextLengthExceeded,
        ),
        (200, None, "<html>not json</html>", EngineBadReply),
        (200, {"choices": []}, None, EngineBadReply),
        (200, {"choices": [{"token_ids": [5], "logprobs": {"content": []}}]}, None, EngineBadReply),
    ],
)
async def test_error_classification(status: int, body: object, text: str | None, error: type) -> None:
    with pytest.raises(error) as e:
        await generate(client_with(reply(status, body, text)))
    assert "\n" not in str(e.value)


async def test_transport_error_is_retryable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(EngineUnavailable) as e:
        await generate(client_with(handler))
    assert e.value.retryable and e.value.to_application_error().non_retryable is False


async def test_prompt_that_no_longer_fits_is_context_length_without_a_request() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return reply(200, GOOD)(request)

    with pytest.raises(ContextLengthExceeded):
        await generate(client_with(handler), prompt=list(range(32)))
    assert calls == ["/v1/models"]
