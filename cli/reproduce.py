"""Reproduce a recorded rollout's first model call from its record and the run's stored config.

`rollouts reproduce RUN ROLLOUT_ID [--engine URL]` re-sends the rollout's first model call to a live engine:
the stored prompt tokens, the sampling settings of the stored config, the recorded seed and the max tokens
the run allowed, through the model call the workers make (`turns.model.call_model`, with the workers'
`EngineClient`); then compares the token ids with the recorded ones. Before trusting the comparison it checks
the lineage: the stored config still hashes to the run's config hash and the record's; the recorded seed is
the one the stored config derives for this rollout; the recorded sampling equals the config's; the engine
serves the version that sampled the recorded turn; the record's environment and verifier versions are those of
the code running now.

Invariant: the verdict is one line (`Reproduction.line`): ``reproduced`` only when every token id matches
and nothing in the lineage differs; otherwise it names the first differing token and every lineage
mismatch. Bad input (unknown run or rollout, a record without a first model call, an unreadable stored
config) raises `ReproduceError` with one line naming the run, rollout and field.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # heavy imports wait until a reproduction runs, so `rollouts --help` stays instant
    from durable_rollouts.contracts.types import SamplingParams
    from durable_rollouts.store.runstore import RunStore
    from durable_rollouts.turns.engine import Sampled


class ReproduceError(RuntimeError):
    """The rollout cannot be reproduced from what the store holds (one line naming the rollout and field)."""


@dataclass
class Reproduction:
    """The outcome of re-running one rollout's first model call."""

    run_id: str
    rollout_id: str
    engine_url: str
    engine_version: str | None
    seed: int | None
    recorded: list[int]
    reproduced: list[int]
    reproduced_versions: list[str | None]
    max_logprob_diff: float | None
    mismatches: list[str] = field(default_factory=list)
    """Lineage differences, each ``what: recorded X, now Y``."""

    @property
    def tokens_match(self) -> bool:
        return self.recorded == self.reproduced

    @property
    def ok(self) -> bool:
        return self.tokens_match and not self.mismatches

    def first_difference(self) -> int | None:
        """Index of the first differing token (or the shorter length), None when equal."""
        if self.tokens_match:
            return None
        for i, (a, b) in enumerate(zip(self.recorded, self.reproduced, strict=False)):
            if a != b:
                return i
        return min(len(self.recorded), len(self.reproduced))

    def line(self) -> str:
        """The verdict in one line."""
        head = f"rollout {self.rollout_id}"
        n = len(self.recorded)
        if self.tokens_match:
            tokens = f"{n}/{n} token ids equal"
        else:
            i = self.first_difference()
            got = self.reproduced[i] if i is not None and i < len(self.reproduced) else "end"
            want = self.recorded[i] if i is not None and i < len(self.recorded) else "end"
            tokens = f"token ids differ at {i} of {n} (recorded {want}, reproduced {got})"
        where = f"engine {self.engine_url} serving {self.engine_version}, seed {self.seed}"
        if self.mismatches:
            return f"{head}: lineage mismatch: {'; '.join(self.mismatches)} ({tokens}; {where})"
        verdict = "reproduced" if self.tokens_match else "not reproduced"
        return f"{head}: {verdict}: {tokens} ({where})"


def reproduce(
    store: RunStore, run_id: str, rollout_id: str, engine_url: str | None = None, timeout_s: float = 120.0
) -> Reproduction:
    """Re-run the first model call of ``rollout_id`` against ``engine_url`` (default: the recorded engine).

    Synchronous (it runs its own event loop): call it from a thread when a loop is already running.

    Raises:
        ReproduceError: The run, the rollout, its prompt or first model call, or the stored config is
            missing or unreadable; or the engine cannot be reached.
    """
    from durable_rollouts.config.load import config_hash
    from durable_rollouts.config.models import Config
    from durable_rollouts.contracts.types import SamplingParams, sampling_params
    from durable_rollouts.records.export import env_versions, rollout_record
    from durable_rollouts.store.runstore import model_segment
    from durable_rollouts.workflows.group import member_seed

    where = f"run {run_id}, rollout {rollout_id}"
    run = store.get_run(run_id)
    if run is None:
        raise ReproduceError(f"run {run_id}: not in the store at {store.location}")
    row = store.rollout(rollout_id)
    if row is None or row["run_id"] != run_id:
        raise ReproduceError(f"{where}: no such rollout record")
    try:
        cfg = Config.model_validate_json(run["config_json"])
    except ValueError as e:
        first = str(e).splitlines()[0]
        raise ReproduceError(f"{where}: stored config (runs.config_json) is unreadable: {first}") from None
    prompt = store.get_segment(rollout_id, "prompt")
    turn = store.get_segment(rollout_id, model_segment(0))
    if prompt is None or not prompt.token_ids:
        raise ReproduceError(f"{where}: no stored prompt tokens (segment 'prompt')")
    if turn is None:
        raise ReproduceError(f"{where}: no recorded first model call (segment {model_segment(0)!r})")
    try:
        sampling = SamplingParams.model_validate_json(row["sampling_json"])
    except ValueError:
        raise ReproduceError(f"{where}: recorded sampling (rollouts.sampling_json) is unreadable") from None
    record = rollout_record(store, row)
    lineage = record["lineage"]

    mismatches: list[str] = []
    stored_hash = config_hash(json.loads(run["config_json"]))  # as stored, whatever fields came since
    if stored_hash != run["config_hash"]:
        mismatches.append(f"stored config hashes to {stored_hash}, run says {run['config_hash']}")
    if lineage.get("config_hash") not in (None, run["config_hash"]):
        mismatches.append(f"config_hash: recorded {lineage['config_hash']}, run {run['config_hash']}")
    want_seed = member_seed(cfg.sampling.seed, rollout_id)
    if sampling.seed != want_seed:
        mismatches.append(f"seed: recorded {sampling.seed}, stored config derives {want_seed}")
    from_cfg = sampling_params(cfg).model_dump(exclude={"seed"})
    for name, value in from_cfg.items():
        if getattr(sampling, name) != value:
            mismatches.append(f"sampling.{name}: recorded {getattr(sampling, name)}, config {value}")
    env_version, verifier_version = env_versions(row["env"])
    for name, now in (("env_version", env_version), ("verifier_version", verifier_version)):
        recorded = lineage.get(name)
        if recorded is None:
            mismatches.append(f"{name}: not recorded, now {now}")
        elif recorded != now:
            mismatches.append(f"{name}: recorded {recorded}, now {now}")
    image = _sandbox_image(store, run_id, row["task_id"], row["env"], cfg)
    if image is not None and lineage.get("sandbox_image") != image:
        mismatches.append(f"sandbox_image: recorded {lineage.get('sandbox_image')}, config {image}")

    url = engine_url or turn.meta.get("engine") or cfg.engine.urls[0]
    turn_versions = sorted({v for v in turn.policy_versions or [] if v is not None})
    engine_version = _engine_version(url, timeout_s)
    if not turn_versions and turn.token_ids:
        mismatches.append(f"policy version: not recorded, engine serves {engine_version}")
    elif len(turn_versions) > 1:
        mismatches.append(f"policy version: the recorded turn spans {', '.join(turn_versions)}")
    elif turn_versions and engine_version != turn_versions[0]:
        mismatches.append(f"policy version: recorded {turn_versions[0]}, engine serves {engine_version}")

    total = cfg.rollout.max_total_tokens
    gen = asyncio.run(_generate(url, cfg.engine.model, prompt.token_ids, sampling, total, rollout_id))
    diffs = [abs(a - b) for a, b in zip(turn.logprobs or [], gen.logprobs, strict=False) if a is not None]
    return Reproduction(
        run_id=run_id,
        rollout_id=rollout_id,
        engine_url=url,
        engine_version=engine_version,
        seed=sampling.seed,
        recorded=list(turn.token_ids),
        reproduced=gen.token_ids,
        reproduced_versions=gen.policy_versions,
        max_logprob_diff=max(diffs) if diffs else None,
        mismatches=mismatches,
    )


def _sandbox_image(store: RunStore, run_id: str, task_id: str, env_name: str, cfg: Any) -> str | None:
    """The image the stored config gives this task's sandbox (None: no sandbox, or env not installed)."""
    from durable_rollouts.environments import registry
    from durable_rollouts.errors import RolloutError

    try:
        env = registry.get(env_name)
        if not env.uses_sandbox:
            return None
        plan = env.sandbox(env.validate_task(store.get_task(run_id, task_id)), cfg.sandbox)
    except (RolloutError, KeyError):
        return None
    return plan.spec.image if plan is not None else None


def _engine_version(url: str, timeout_s: float) -> str | None:
    """The weight version the engine announces (``/weight_info``), None if it announces none."""
    import httpx

    try:
        resp = httpx.get(f"{url}/weight_info", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ReproduceError(f"engine {url}: unreachable ({type(e).__name__}: {e})") from None
    if resp.status_code != 200:
        return None
    try:
        data: Any = resp.json()
    except ValueError:
        return None
    version = data.get("weight_version") if isinstance(data, dict) else None
    return str(version) if version is not None else None


async def _generate(
    url: str, model: str, prompt: list[int], sampling: SamplingParams, max_total_tokens: int, rollout_id: str
) -> Sampled:
    """The first model call again, through the call the workers make (``turns.model.call_model``: the same
    budget under the run's token limit and the engine's window)."""
    from durable_rollouts.contracts.types import TruncationReason
    from durable_rollouts.engines.client import EngineClient
    from durable_rollouts.errors import RolloutError
    from durable_rollouts.turns.model import call_model

    client = EngineClient()
    try:
        request_id = f"reproduce/{rollout_id}/{uuid.uuid4().hex[:8]}"
        gen = await call_model(
            client, url, model, prompt, sampling, sampling.max_tokens, max_total_tokens, request_id
        )
    except RolloutError as e:
        raise ReproduceError(f"rollout {rollout_id}: engine {url}: {e}") from None
    finally:
        await client.aclose()
    if isinstance(gen, TruncationReason):
        raise ReproduceError(f"rollout {rollout_id}: engine {url}: the first model call is truncated ({gen})")
    return gen


def as_json(rep: Reproduction) -> str:
    """The reproduction as one JSON object (for scripts)."""
    return json.dumps(
        {
            "run_id": rep.run_id,
            "rollout_id": rep.rollout_id,
            "ok": rep.ok,
            "tokens_match": rep.tokens_match,
            "engine_url": rep.engine_url,
            "engine_version": rep.engine_version,
            "seed": rep.seed,
            "recorded": rep.recorded,
            "reproduced": rep.reproduced,
            "max_logprob_diff": rep.max_logprob_diff,
            "mismatches": rep.mismatches,
            "line": rep.line(),
        }
    )


def reproduce_command(
    run_id: str,
    rollout_id: str,
    engine: Annotated[
        str | None, typer.Option("--engine", help="Engine base URL (default: the one the record names).")
    ] = None,
    as_json_: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
) -> None:
    """Re-run a recorded rollout's first model call from the stored config, prompt and seed; compare the
    token ids and the lineage. Exit 0 when reproduced, 1 when tokens or lineage differ, 2 on bad input."""
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.store import open_store, store_exists, store_url

    if not store_exists():
        typer.echo(f"error: no run store at {store_url()} (set ROLLOUTS_STORE or ROLLOUTS_HOME)", err=True)
        raise typer.Exit(2)
    try:
        rep = reproduce(open_store(), run_id, rollout_id, engine)
    except (ReproduceError, ConfigError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(as_json(rep) if as_json_ else rep.line())
    raise typer.Exit(0 if rep.ok else 1)


__all__ = ["ReproduceError", "Reproduction", "as_json", "reproduce", "reproduce_command"]
