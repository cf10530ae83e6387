"""The closed GRPO loop: a run generates, the trainer consumes the feed, steps, saves, publishes, repeats.

Invariants:
- The trainer starts from the weights of the version the engines serve, as the store recorded it (the
  version must be published in the store; ``rollouts stack up`` records the bundled policy as ``v0``).
- Every optimiser step trains only on groups the feed handed out for the trainer's *current* version
  (``TrainerFeed.take(n, current, max_lag)``), from the records' token ids, loss masks, recorded logprobs
  and GRPO advantages; nothing is re-tokenized or re-sampled.
- Every step ends with a new immutable version: weights saved under ``<weights_root>/<version>/`` and
  published to every engine (pause keep, reload, set version, reset prefix cache, resume) before the next
  batch is taken, so the feed judges freshness against what the engines really serve.
- The loop ends after ``max_steps`` steps, or once the run is done and the feed has nothing fresh left; it
  then waits for the run to end so the books it reports are final (generated = consumed + discarded +
  waiting) and refuses to report unbalanced books.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from durable_rollouts.config.load import config_hash
from durable_rollouts.config.models import Config
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.engines.policy import publish
from durable_rollouts.store import RunStore, open_store
from durable_rollouts.trainer.batch import TensorBatch, to_tensors
from durable_rollouts.trainer.feed import FeedGroup, TrainerFeed
from durable_rollouts.trainer.loss import clipped_policy_loss, token_logprobs
from durable_rollouts.trainer.policy_io import load_policy, save_policy
from durable_rollouts.trainer.settings import TrainerSettings

BEHAVIOUR_LOGPROBS = "processed_logprobs"
"""The logprobs mode the loss's importance ratios assume (after temperature and top-k/top-p, the
distribution the tokens were really drawn from); the feed discards groups declaring another."""


class TrainerError(RuntimeError):
    """The loop cannot start or continue (one line: what is wrong and what to do)."""


# -- one optimisation step (pure torch; no I/O) -----------------------------------------------------------


@dataclass
class Optimiser:
    """AdamW with linear warm-up, and the generator of the mini-batch shuffles."""

    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    gen: torch.Generator

    @classmethod
    def for_model(cls, model: torch.nn.Module, ts: TrainerSettings) -> Optimiser:
        opt = torch.optim.AdamW(
            model.parameters(), lr=ts.lr, betas=(0.9, ts.adam_beta2), weight_decay=ts.weight_decay
        )
        warm = ts.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm))
        return cls(opt, sched, torch.Generator().manual_seed(ts.seed))


def train_step(
    model: torch.nn.Module, optimiser: Optimiser, tb: TensorBatch, ts: TrainerSettings
) -> dict[str, float]:
    """``ts.epochs`` passes of ``ts.minibatches`` AdamW updates over ``tb`` with the clipped GRPO loss.

    Returns:
        Means over the updates of loss, importance ratio, clip fraction and approximate KL, the tokens of
        the batch, and the first update's mean ratio (``ratio_first``: behaviour vs current at step start).
    """
    model.train()
    n = tb.token_ids.shape[0]
    parts = min(ts.minibatches, n)
    rows: list[dict[str, float]] = []
    for _ in range(ts.epochs):
        order = torch.randperm(n, generator=optimiser.gen).tolist() if parts > 1 else list(range(n))
        for k in range(parts):
            sub = tb.rows(order[k * n // parts : (k + 1) * n // parts])
            logits = model(input_ids=sub.token_ids, attention_mask=sub.attention_mask).logits
            logp = token_logprobs(logits, sub.token_ids, sub.temperature)
            loss, st = clipped_policy_loss(
                logp, sub.logp_behaviour, sub.advantages, sub.mask, ts.clip_low, ts.clip_high
            )
            optimiser.opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ts.max_grad_norm)
            optimiser.opt.step()
            optimiser.sched.step()
            rows.append({"loss": st.loss, "ratio": st.mean_ratio, "clip_fraction": st.clip_fraction,
                         "approx_kl": st.approx_kl, "grad_norm": float(norm)})  # fmt: skip
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    out["ratio_first"] = rows[0]["ratio"]
    out["tokens"] = float(tb.tokens)
    out["updates"] = float(len(rows))
    return out


# -- the loop ---------------------------------------------------------------------------------------------


@dataclass
class StepLog:
    """What one step consumed and did (one line of the loop's metrics)."""

    step: int
    trained_on: str
    published: str
    groups: int
    rollouts: int
    tokens: int
    group_lags: dict[int, int]
    reward_mean: float
    wait_s: float
    train_s: float
    publish_s: float
    stats: dict[str, float] = field(default_factory=dict)


def next_version(store: RunStore, root: Path) -> str:
    """The first ``v<n>`` (n = number of versions so far, counting up) unused in the store and on disk."""
    known = {p["version"] for p in store.policies()}
    n = len(known)
    while f"v{n}" in known or (root / f"v{n}").exists():
        n += 1
    return f"v{n}"


def _engine_version(url: str) -> str:
    import httpx

    try:
        return str(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])
    except Exception as e:
        raise TrainerError(f"engine {url}: cannot read /weight_info ({type(e).__name__}: {e})") from None


def _token_lags(groups: list[FeedGroup], current: str, order: dict[str, int]) -> Counter[int]:
    out: Counter[int] = Counter()
    for g in groups:
        for r in g.rollouts:
            for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True):
                if m and v is not None:
                    out[order[current] - order[v]] += 1
    return out


class Loop:
    """One closed-loop session over one run (see the module invariants)."""

    def __init__(
        self,
        cfg: Config,
        ts: TrainerSettings,
        run_id: str,
        home: Path,
        log: Callable[[str], None] = print,
        client: Any = None,
    ) -> None:
        """``client``: a connected Temporal client to start the run with (default: connect to
        ``cfg.temporal.address``)."""
        self.cfg, self.ts, self.run_id, self.home, self.log = cfg, ts, run_id, Path(home), log
        self.client = client
        self.store = open_store(home=self.home)  # $ROLLOUTS_STORE if set, else the home directory
        self.feed = TrainerFeed(self.store, run_id)
        self.urls = [u.rstrip("/") for u in cfg.engine.urls]
        self.weights_root = (
            resolve_path(ts.weights_root, "trainer.weights_root")
            if ts.weights_root
            else self.home / "policies"
        )
        self.steps: list[StepLog] = []
        self.token_lags: Counter[int] = Counter()
        self.trained_tokens = 0

    # -- set-up ---------------------------------------------------------------------------------------
    def starting_version(self) -> dict[str, Any]:
        """The published store row of the version every engine serves now."""
        versions = {u: _engine_version(u) for u in self.urls}
        if len(set(versions.values())) > 1:
            raise TrainerError(f"engines serve different versions {versions}; publish one version to all")
        version = next(iter(versions.values()))
        row = self.store.get_policy(version)
        if row is None or row["status"] != "published":
            raise TrainerError(
                f"engine serves version {version!r}, which the store at {self.store.location} never "
                "published; "
                "start the stack with `rollouts stack up` (it records v0) or `rollouts policy publish`"
            )
        return row

    async def evaluate(self, label: str) -> dict[str, Any] | None:
        from durable_rollouts.contracts.types import SamplingParams
        from durable_rollouts.environments import registry
        from durable_rollouts.environments.tasks import load_tasks
        from durable_rollouts.trainer.evaluate import accuracy

        if self.ts.eval_samples_per_task == 0:
            return None
        env = self.cfg.run.env
        tasks = load_tasks(resolve_path(self.ts.eval_task_file, "trainer.eval_task_file"), env)
        s = self.cfg.sampling
        sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  max_tokens=s.max_tokens, seed=None,
                                  logprob_mode=self.cfg.engine.logprob_mode)  # fmt: skip
        t0 = time.monotonic()
        res = await accuracy(self.urls[0], self.cfg.engine.model, registry.get(env), tasks, sampling,
                                  self.ts.eval_samples_per_task, self.ts.eval_seed,
                                  self.ts.eval_concurrency)  # fmt: skip
        out = {**res.as_dict(), "seconds": round(time.monotonic() - t0, 2)}
        self.log(f"eval {label}: {res.version} accuracy {res.accuracy:.3f} ± {res.stderr:.3f} "
                 f"({res.correct}/{res.samples}, {out['seconds']} s)")  # fmt: skip
        return out

    async def start_run(self):
        from temporalio.service import RPCError, RPCStatusCode

        from durable_rollouts.contracts.client import connect, describe
        from durable_rollouts.contracts.types import RunInput
        from durable_rollouts.environments.fleet import require_worker
        from durable_rollouts.errors import ConfigError
        from durable_rollouts.workflows.run import RunWorkflow

        client = self.client
        if client is None:
            conn = self.cfg.temporal.connection()
            where = describe(conn)  # a bad profile or certificate file: its own one-line ConfigError
            try:
                client = await connect(conn)
            except Exception as e:
                raise TrainerError(f"cannot reach Temporal at {where} ({e}); is the stack up?") from None
        handle = client.get_workflow_handle_for(RunWorkflow.run, self.run_id)
        try:
            await handle.describe()
            raise TrainerError(
                f"run {self.run_id} already exists; the loop starts a fresh run (new --run-id)"
            )
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
        try:  # on its environment's queue, once a live worker polls it (environments/fleet.py)
            queue = await require_worker(client, self.cfg.temporal.task_queue, self.cfg.run.env)
        except ConfigError as e:
            raise TrainerError(str(e)) from None
        return await client.start_workflow(
            RunWorkflow.run,
            RunInput(
                run_id=self.run_id, config=self.cfg.model_dump(mode="json"), config_hash=config_hash(self.cfg)
            ),
            id=self.run_id,
            task_queue=queue,
        )

    # -- the loop -------------------------------------------------------------------------------------
    async def _collect(self, current: str, run_done: asyncio.Task) -> tuple[list[FeedGroup], float]:
        """Groups for one step: wait until ``groups_per_step`` are fresh, or the run ended (take the rest)."""
        groups: list[FeedGroup] = []
        t0 = time.monotonic()
        last_progress, seen = time.monotonic(), -1
        while True:
            finished = run_done.done()  # read before the take: a run that ended is fully in the store
            want = self.ts.groups_per_step - len(groups)
            batch = await asyncio.to_thread(
                self.feed.take, want, current, self.ts.max_lag, self.ts.drop_zero_variance, BEHAVIOUR_LOGPROBS
            )
            groups += batch.groups
            for d in batch.discarded:
                self.log(f"  discarded {d.group_id}: {d.reason}")
            if len(groups) >= self.ts.groups_per_step or finished:
                return groups, time.monotonic() - t0
            n = len(self.store.groups(self.run_id))
            if n != seen:
                seen, last_progress = n, time.monotonic()
            elif time.monotonic() - last_progress > self.ts.stall_timeout_s:
                raise TrainerError(
                    f"run {self.run_id}: no group completed for {self.ts.stall_timeout_s:.0f} s; "
                    "is a worker polling the run's task queue?"
                )
            await asyncio.sleep(self.ts.poll_s)

    async def run(self) -> dict[str, Any]:
        """Evaluate, start the run, train until it is consumed, evaluate again; returns the metrics."""
        torch.manual_seed(self.ts.seed)
        torch.set_num_threads(self.ts.threads)
        row = self.starting_version()
        current, source = row["version"], Path(row["weights_dir"])
        model = load_policy(source)
        optimiser = Optimiser.for_model(model, self.ts)
        self.log(f"trainer starts from {current} ({source}); run {self.run_id}")
        eval_start = await self.evaluate("start")
        handle = await self.start_run()
        run_done = asyncio.ensure_future(handle.result())
        t_loop = time.monotonic()
        pad = int(getattr(model.config, "pad_token_id", None) or 0)
        try:
            while len(self.steps) < self.ts.max_steps:
                groups, wait_s = await self._collect(current, run_done)
                if not groups:
                    break
                order = {p["version"]: i for i, p in enumerate(self.store.policies())}
                self.token_lags += _token_lags(groups, current, order)
                records = [r for g in groups for r in g.rollouts]
                t0 = time.monotonic()
                tb = to_tensors(records, pad)
                stats = await asyncio.to_thread(train_step, model, optimiser, tb, self.ts) if tb else {}
                self.trained_tokens += tb.tokens if tb else 0
                t1 = time.monotonic()
                version = next_version(self.store, self.weights_root)
                out = save_policy(model, source, self.weights_root / version)
                await asyncio.to_thread(publish, self.urls, version, out, self.store)
                t2 = time.monotonic()
                rewards = [r["reward"] for r in records if r["reward"] is not None]
                step = StepLog(
                    step=len(self.steps) + 1, trained_on=current, published=version, groups=len(groups),
                    rollouts=len(records), tokens=tb.tokens if tb else 0,
                    group_lags=dict(Counter(g.lag for g in groups)),
                    reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
                    wait_s=round(wait_s, 3), train_s=round(t1 - t0, 3), publish_s=round(t2 - t1, 3),
                    stats={k: round(v, 5) for k, v in stats.items()},
                )  # fmt: skip
                self.steps.append(step)
                self.log(
                    f"step {step.step:3d} {current}->{version}: {step.groups} groups, {step.tokens} tokens, "
                    f"lags {step.group_lags}, reward {step.reward_mean:.3f}, wait {step.wait_s:.1f} s, "
                    f"train {step.train_s:.2f} s, publish {step.publish_s:.2f} s, "
                    f"ratio {stats.get('ratio_first', 1):.3f}, clip {stats.get('clip_fraction', 0):.3f}"
                )
                current = version
        finally:
            loop_s = time.monotonic() - t_loop
            if not run_done.done():
                self.log(f"waiting for run {self.run_id} to finish (its remaining groups stay in the feed)")
        try:
            await asyncio.wait_for(asyncio.shield(run_done), timeout=self.ts.stall_timeout_s)
        except TimeoutError:
            raise TrainerError(
                f"run {self.run_id} did not finish within {self.ts.stall_timeout_s:.0f} s"
            ) from None
        eval_end = await self.evaluate("end")
        return self.metrics(eval_start, eval_end, loop_s)

    def metrics(
        self, eval_start: dict[str, Any] | None, eval_end: dict[str, Any] | None, loop_s: float
    ) -> dict[str, Any]:
        ledger = self.feed.ledger().check()
        report = self.feed.discard_report()
        wait = sum(s.wait_s for s in self.steps)
        train = sum(s.train_s for s in self.steps)
        pub = sum(s.publish_s for s in self.steps)
        gen = ledger.generated
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "steps": len(self.steps),
            "versions": [s.published for s in self.steps],
            "loop_wall_s": round(loop_s, 2),
            "accuracy_start": eval_start,
            "accuracy_end": eval_end,
            "accuracy_delta_points": (
                round(100 * (eval_end["accuracy"] - eval_start["accuracy"]), 2)
                if eval_start and eval_end else None
            ),
            "ledger": {k: {"records": getattr(ledger, k).records, "tokens": getattr(ledger, k).tokens}
                       for k in ("generated", "consumed", "discarded", "waiting")},
            "discard_rate_records": round(ledger.discarded.records / gen.records, 4) if gen.records else None,
            "discard_rate_tokens": round(ledger.discarded.tokens / gen.tokens, 4) if gen.tokens else None,
            "discards_by_reason": report["by_reason"],
            "freshness": {
                "group_lag": _lag_totals(self.steps),
                "token_lag": dict(sorted(self.token_lags.items())),
                "max_lag": self.ts.max_lag,
            },
            "trainer_time": {
                "wait_s": round(wait, 2), "train_s": round(train, 2), "save_publish_s": round(pub, 2),
                "idle_ratio": round(wait / loop_s, 4) if loop_s else None,
            },
            "tokens_reaching_update": round(self.trained_tokens / gen.tokens, 4) if gen.tokens else None,
            "trained_tokens": self.trained_tokens,
            "reward_by_step": [round(s.reward_mean, 4) for s in self.steps],
            "trainer": self.ts.model_dump(mode="json"),
            "run": {"num_groups": self.cfg.run.num_groups, "group_size": self.cfg.run.group_size,
                    "max_inflight_groups": self.cfg.run.max_inflight_groups,
                    "temperature": self.cfg.sampling.temperature},
            "step_log": [s.__dict__ for s in self.steps],
        }  # fmt: skip
        return out


def _lag_totals(steps: list[StepLog]) -> dict[int, int]:
    total: Counter[int] = Counter()
    for s in steps:
        total.update(s.group_lags)
    return dict(sorted(total.items()))


def write_metrics(metrics: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
