"""simengine: a simulated vLLM engine, serving over HTTP the exact API subset the project uses.

It answers ``POST /inference/v1/generate`` (token ids in; token ids, logprobs and weight-version spans
out), ``POST /tokenize`` and ``POST /detokenize`` with the bundled policy's own tokenizer (so token ids
match real vLLM), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (vLLM's Prometheus names),
``POST /update_weight_version`` and ``GET /weight_info``; plus its own ``GET``/``POST /fault`` (fault
injection) and ``POST /mode`` (scripted mode and rules at runtime).

Tokens come from a pluggable policy instead of a model: a scripted coding agent that solves (or fails, or
fumbles) the task named in the conversation, or random bytes. Delays, capacity and faults are configurable,
so it serves scripted end-to-end tests, fault-injection tests and scale benchmarks on machines with no
accelerator.

Details copied from vLLM 0.32 as recorded against the bundled policy: the EOS token ``<|end|>`` (258) is
the last of the returned token ids when ``finish_reason`` is "stop"; ``/detokenize`` keeps special tokens;
the reply's ``request_id`` is ``generate-tokens-<request_id>``; a prompt of ``max_model_len`` tokens or
more is a 400 whose message says "longer than the maximum model length"; an unknown model is a 404.

With ``SimSettings(timing=TimingSettings(...))`` it also models time and memory: vLLM's continuous-batching
step loop, a finite pool of KV blocks with prefix caching, and recompute preemption, paced against the wall
clock (optionally sped up), with heavy-tailed turn lengths from the random policy (`simengine.timing`
documents how each parameter maps to a real GPU). Without it, requests only wait for fixed delays.

It is NOT a replacement for tests against real vLLM: it has no model and no sampling, its timing model is a
linear cost model, and it reproduces only the parts of vLLM's behaviour listed above. Anything that depends
on how vLLM actually behaves must also be tested against vLLM.

Start it with ``python -m durable_rollouts.simengine --port P --model tiny --tasks
environments/coding/coding_env/data/coding.jsonl --policy scripted --mode reference``, or in process::

    async with SimEngine(SimSettings(tasks=...)).serve(port=0) as url:
        ...

Invariant: a request the real engine would accept gets a reply of the shape the real engine gives, and
the same request in the same state gets the same tokens (the scripted policy is deterministic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_rollouts.simengine.engine import SimEngine
    from durable_rollouts.simengine.faults import Faults, FaultUpdate
    from durable_rollouts.simengine.policies import SCRIPTED_LOGPROB
    from durable_rollouts.simengine.settings import Mode, ModeRule, PolicyName, SimSettings, TimingSettings

__all__ = [
    "SCRIPTED_LOGPROB",
    "FaultUpdate",
    "Faults",
    "Mode",
    "ModeRule",
    "PolicyName",
    "SimEngine",
    "SimSettings",
    "TimingSettings",
]

# Imported on first use, so `python -m durable_rollouts.simengine --help` answers before aiohttp and
# tokenizers load.
_HOMES = {
    "SimEngine": "durable_rollouts.simengine.engine",
    "Faults": "durable_rollouts.simengine.faults",
    "FaultUpdate": "durable_rollouts.simengine.faults",
    "SCRIPTED_LOGPROB": "durable_rollouts.simengine.policies",
    "Mode": "durable_rollouts.simengine.settings",
    "ModeRule": "durable_rollouts.simengine.settings",
    "PolicyName": "durable_rollouts.simengine.settings",
    "SimSettings": "durable_rollouts.simengine.settings",
    "TimingSettings": "durable_rollouts.simengine.settings",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'simengine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
