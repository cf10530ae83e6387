"""Request bodies the simulated engine accepts, and vLLM's error body.

Invariant: exactly the subset of vLLM's API that `engines.client.EngineClient` and the stack
scripts use is accepted. A field outside it is a 400 here, although vLLM 0.32 accepts and ignores unknown
fields: stricter on purpose, so a client that starts relying on a field this engine does not implement
fails loudly instead of being silently simulated wrong. Errors use vLLM's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(_Body):
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0)
    """0: the sampled token's logprob only (what the project asks for); None: no logprobs."""
    detokenize: bool = True


class GenerateIn(_Body):
    model: str | None = None
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParamsIn
    output_mode: Literal["tokens"] = "tokens"
    stream: Literal[False] = False


class Message(_Body):
    role: str
    content: str


class TokenizeChatIn(_Body):
    model: str | None = None
    messages: list[Message]
    tools: list[dict[str, object]] | None = None
    """Accepted as vLLM does; the bundled policy's template does not render them."""
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizePromptIn(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeIn(_Body):
    model: str | None = None
    tokens: list[int]


class WeightVersionIn(_Body):
    new_version: str = Field(min_length=1)


class ModeIn(_Body):
    """Body of ``POST /mode``: the scripted policy's default mode and, if given, its rules."""

    mode: str | None = None
    rules: list[str] | None = None
    """``task:PREFIX=MODE`` or ``request:PREFIX=MODE``; replaces the current rules."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, dict[str, object]]:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    kind = kinds.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
