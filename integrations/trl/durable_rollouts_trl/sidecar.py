"""The sidecar: the only process of this client that imports the durable-rollouts core.

The core's import packages have generic top-level names (``config``, ``store``, ``metrics``, ``trainer``,
...). A trainer's process often holds modules of the same names (the user's own ``config.py``, a
``trainer.py`` beside the script), and whichever is imported first wins there. So nothing in the trainer's
process imports the core: :class:`durable_rollouts_trl.bridge.Bridge` starts this module as a child,
``python -P -m durable_rollouts_trl.sidecar`` (``-P``: neither the working directory nor a script's folder
goes on ``sys.path``; the trainer's ``PYTHONPATH`` is replaced by ``DURABLE_ROLLOUTS_PYTHONPATH``), and
talks to it in JSON lines on stdin/stdout: one request ``{"op": ..., **args}`` -> one reply ``{"ok": true,
"result": ...}`` or ``{"ok": false, "error": "<one line>"}``.

Invariants:
- Every operation goes through the core's public API (``trainer.feed.TrainerFeed``,
  ``engines.policy.publish``, ``store.open_store``, the run workflow as ``rollouts run`` starts it): the
  books, the freshness rule and the publish protocol are the core's, never re-implemented here.
- Replies are JSON (records in the export format, ``records/export.py``); stdout carries nothing else (the
  core's logs go to stderr).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


class SidecarError(RuntimeError):
    """A request the core refused (one line)."""


class Sidecar:
    def __init__(self, home: str, store_url: str | None) -> None:
        from durable_rollouts.store import open_store

        self.home = Path(home)
        self.store = open_store(store_url or self.home)
        self.loop = asyncio.new_event_loop()
        self._clients: dict[tuple[str, str], Any] = {}
        self._runs: dict[str, Any] = {}

    # -- helpers -------------------------------------------------------------------------------------
    def _client(self, address: str, namespace: str) -> Any:
        from durable_rollouts.contracts.client import connect

        key = (address, namespace)
        if key not in self._clients:
            try:
                self._clients[key] = self.loop.run_until_complete(connect(address, namespace))
            except Exception as e:
                raise SidecarError(f"cannot reach Temporal at {address} ({e}); is the stack up?") from None
        return self._clients[key]

    def _config(self, config: str | None, overrides: list[str]) -> Any:
        from durable_rollouts.config.load import ConfigError, load_config
        from durable_rollouts.config.paths import resolve_path

        try:
            cfg = load_config(Path(config) if config else None, overrides)
        except ConfigError as e:
            raise SidecarError(str(e)) from None
        path = resolve_path(cfg.run.task_file, "run.task_file")
        return cfg.model_copy(update={"run": cfg.run.model_copy(update={"task_file": str(path)})})

    # -- operations ----------------------------------------------------------------------------------
    def op_hello(self) -> dict[str, Any]:
        from durable_rollouts import store

        return {"core": str(Path(store.__file__).parent.parent), "store": self.store.location}

    def op_policies(self) -> list[dict[str, Any]]:
        return self.store.policies()

    def op_settings(self, config: str | None, overrides: list[str]) -> dict[str, Any]:
        """The run config as JSON (its sampling settings and engines) and its tasks."""
        from durable_rollouts.environments.tasks import load_tasks

        cfg = self._config(config, overrides)
        return {"config": cfg.model_dump(mode="json"), "tasks": load_tasks(cfg.run.task_file, cfg.run.env)}

    def op_start_run(
        self, config: str | None, overrides: list[str], run_id: str, tasks: list[dict[str, Any]] | None = None
    ) -> str:
        """Start the run (``rollouts run``'s way: on its environment's queue, tasks uploaded once a worker
        polls it); attach when it exists. ``tasks``: these tasks instead of the task file's."""
        from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

        from durable_rollouts.config.load import config_hash
        from durable_rollouts.contracts.types import RunInput
        from durable_rollouts.environments.fleet import require_worker
        from durable_rollouts.environments.tasks import load_tasks
        from durable_rollouts.errors import ConfigError
        from durable_rollouts.workflows.run import RunWorkflow

        cfg = self._config(config, overrides)
        client = self._client(cfg.temporal.address, cfg.temporal.namespace)
        rows = tasks if tasks is not None else load_tasks(cfg.run.task_file, cfg.run.env)

        async def go() -> Any:
            try:
                queue = await require_worker(client, cfg.temporal.task_queue, cfg.run.env)
            except ConfigError as e:
                raise SidecarError(str(e)) from None
            self.store.put_tasks(run_id, rows)
            return await client.start_workflow(
                RunWorkflow.run,
                RunInput(run_id=run_id, config=cfg, config_hash=config_hash(cfg)),
                id=run_id,
                task_queue=queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )

        self._runs[run_id] = self.loop.run_until_complete(go())
        return run_id

    def op_run_state(self, run_id: str) -> dict[str, Any]:
        """``{"running": bool, "status": ...}`` of a run this sidecar started."""
        handle = self._runs.get(run_id)
        if handle is None:
            raise SidecarError(f"run {run_id}: not started by this sidecar")
        desc = self.loop.run_until_complete(handle.describe())
        status = desc.status.name if desc.status is not None else "UNKNOWN"
        return {"running": status == "RUNNING", "status": status}

    def op_wait_run(self, run_id: str, timeout_s: float) -> str:
        handle = self._runs.get(run_id)
        if handle is None:
            raise SidecarError(f"run {run_id}: not started by this sidecar")
        try:
            self.loop.run_until_complete(asyncio.wait_for(handle.result(), timeout_s))
        except TimeoutError:
            raise SidecarError(f"run {run_id} did not finish within {timeout_s:.0f} s") from None
        return run_id

    def op_records(self, run_id: str) -> list[dict[str, Any]]:
        from durable_rollouts.records.export import iter_run

        return list(iter_run(self.store, run_id))

    def op_take(
        self, run_id: str, n: int, current: str, max_lag: int, drop_zero_variance: bool, logprob_mode: str
    ) -> dict[str, Any]:
        from durable_rollouts.trainer.feed import FeedError, TrainerFeed

        try:
            batch = TrainerFeed(self.store, run_id).take(
                n, current, max_lag, drop_zero_variance, logprob_mode
            )
        except FeedError as e:
            raise SidecarError(str(e)) from None
        return {
            "batch_id": batch.batch_id,
            "groups": [{"group_id": g.group_id, "task_id": g.task_id, "lag": g.lag, "versions": g.versions,
                        "group": g.group, "rollouts": g.rollouts} for g in batch.groups],
            "discarded": [d.__dict__ for d in batch.discarded],
        }  # fmt: skip

    def op_put_evidence(self, run_id: str, batch_id: str, record: dict[str, Any]) -> bool:
        """Keep a consumed batch's off-policy evidence with the run (the run report shows it)."""
        return self.store.put_offpolicy_evidence(run_id, batch_id, record)

    def op_ledger(self, run_id: str) -> dict[str, Any]:
        from durable_rollouts.trainer.feed import TrainerFeed

        led = TrainerFeed(self.store, run_id).ledger()
        out = {k: getattr(led, k).__dict__ for k in ("generated", "consumed", "discarded", "waiting")}
        return {**out, "balanced": led.balanced}

    def op_engine_versions(self, urls: list[str]) -> dict[str, str]:
        import httpx

        return {
            u: str(httpx.get(f"{u.rstrip('/')}/weight_info", timeout=10).json()["weight_version"])
            for u in urls
        }

    def op_evaluate(self, config: str | None, overrides: list[str], samples_per_task: int, seed: int) -> Any:
        """Accuracy on the run's tasks (math) through the first engine at the run's sampling settings
        (trainer/evaluate.py)."""
        from durable_rollouts.contracts.types import SamplingParams
        from durable_rollouts.environments import registry
        from durable_rollouts.environments.tasks import load_tasks
        from durable_rollouts.trainer.evaluate import accuracy

        cfg = self._config(config, overrides)
        s = cfg.sampling
        sampling = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            seed=None,
            logprob_mode=cfg.engine.logprob_mode,
        )
        tasks = load_tasks(cfg.run.task_file, cfg.run.env)
        env = registry.get(cfg.run.env)
        res = self.loop.run_until_complete(
            accuracy(cfg.engine.urls[0], cfg.engine.model, env, tasks, sampling, samples_per_task, seed)
        )
        return res.as_dict()

    def op_publish(self, urls: list[str], version: str, weights_dir: str) -> dict[str, Any]:
        from durable_rollouts.engines.policy import PolicyError, publish

        t0 = time.monotonic()
        try:
            rec = publish(urls, version, Path(weights_dir), self.store)
        except PolicyError as e:
            raise SidecarError(str(e)) from None
        return {"version": rec.version, "seq": rec.seq, "seconds": round(time.monotonic() - t0, 3)}


def main() -> None:
    home, store_url = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None)
    out = sys.stdout
    sys.stdout = sys.stderr  # the core's prints must not corrupt the reply stream
    try:
        side = Sidecar(home, store_url)
    except Exception as e:
        out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ok": True, "result": "ready"}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            reply = {"ok": True, "result": getattr(side, f"op_{op}")(**req)}
        except SidecarError as e:
            reply = {"ok": False, "error": str(e)}
        except Exception as e:
            reply = {"ok": False, "error": f"{op}: {type(e).__name__}: {e}"}
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
