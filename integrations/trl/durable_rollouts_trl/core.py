"""The trainer process's handle on the durable-rollouts core: :class:`Core`, in the trainer's own process.

The core installs under one import namespace (``durable_rollouts.*``), so it loads beside TRL, transformers
and a trainer's own ``config.py``, ``store.py`` or ``trainer.py`` without a name colliding; this client
imports it directly. :class:`Core` is the one object the rest of the client (worker.py, rollout_func.py,
bench_loop.py) calls for anything the core does: the run store, the trainer feed, publishing, starting and
awaiting runs, evaluation. This module replaces the former ``bridge.py``/``sidecar.py`` pair; no child
process is started.

Invariants:
- Every operation goes through the core's public API (``trainer.feed.TrainerFeed``,
  ``engines.policy.publish``, ``store.open_store``, the run workflow as ``rollouts run`` starts it): the
  books, the freshness rule and the publish protocol are the core's, never re-implemented here.
- The core's async calls (the Temporal client, evaluation) run on one event loop in a background thread
  owned by this object (``durable-rollouts-core``, started on first need, stopped by :meth:`Core.close`).
  Any thread may call, including one whose own asyncio loop is running: the call blocks that thread until
  the reply (from async code, call through ``asyncio.to_thread``). A call from the background loop's own
  thread is refused (it would wait on itself). Synchronous operations (the store, the feed, publishing)
  run in the caller's thread; the store keeps one connection per thread.
- An error of an operation reaches the caller as one :class:`CoreError` with a one-line message: the
  core's own message for the errors it raises on purpose (config, store, feed, publish, evaluation), else
  ``<operation>: <type>: <message>``; the original exception is its ``__cause__``.
- After :meth:`Core.close` (loop stopped, store connections closed) every operation raises CoreError.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from durable_rollouts.engines.policy import PolicyError
from durable_rollouts.errors import RolloutError
from durable_rollouts.store import open_store
from durable_rollouts.trainer.feed import FeedError

if TYPE_CHECKING:
    from durable_rollouts.config.models import Config
    from durable_rollouts.trainer.evaluate import EvalResult
    from durable_rollouts.trainer.feed import Batch, Ledger

T = TypeVar("T")


class CoreError(RuntimeError):
    """The core refused a request, or it failed (one line); the original exception is ``__cause__``."""


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _expected() -> tuple[type[BaseException], ...]:
    """The errors the core raises on purpose: their message alone is the one line. (Those of modules not
    imported yet cannot have been raised, and are not imported here: policy_io would import torch.)"""
    out: list[type[BaseException]] = [RolloutError, FeedError, PolicyError]
    for module, name in (
        ("durable_rollouts.trainer.evaluate", "EvalError"),
        ("durable_rollouts.trainer.policy_io", "PolicyIOError"),
    ):
        if module in sys.modules:
            out.append(getattr(sys.modules[module], name))
    return tuple(out)


@dataclass(frozen=True)
class Settings:
    """A run config (overrides applied, its task file resolved) and that task file's tasks."""

    config: Config
    tasks: list[dict[str, Any]]


class _LoopThread:
    """One asyncio event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="durable-rollouts-core", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise CoreError("a core operation was called from the core's own event loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def stop(self) -> None:
        if self.thread.is_alive() and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=30)


class Core:
    """The core over the run store in ``home`` (or ``store_url``), in this process (see the module)."""

    def __init__(self, home: str | Path, store_url: str | None = None) -> None:
        self.home = Path(home)
        self._closed = False
        self._lock = threading.Lock()
        self._loop: _LoopThread | None = None
        self._stop_loop: weakref.finalize | None = None
        self._clients: dict[Any, Any] = {}
        self._runs: dict[str, Any] = {}
        with self._op("open_store"):
            self.store = open_store(store_url or self.home)

    # -- plumbing ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _op(self, op: str) -> Iterator[None]:
        """Raise any error of operation ``op`` as one CoreError (see the module invariants)."""
        if self._closed:
            raise CoreError(f"{op}: the durable-rollouts core handle is closed")
        try:
            yield
        except CoreError:
            raise
        except Exception as e:
            if self._closed:
                raise CoreError(f"{op}: the durable-rollouts core handle was closed during the call") from e
            if isinstance(e, _expected()):
                raise CoreError(_one_line(str(e)) or type(e).__name__) from e
            raise CoreError(_one_line(f"{op}: {type(e).__name__}: {e}")) from e

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop (started on first use) and return its result."""
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread()
                self._stop_loop = weakref.finalize(self, _LoopThread.stop, self._loop)
            loop = self._loop
        return loop.run(coro)

    def _client(self, temporal: Any) -> Any:
        """The Temporal client of a run config's ``[temporal]`` section, reached as ``rollouts run`` reaches
        it (its settings, then the ``TEMPORAL_*`` variables, then the CLI's profile, then the embedded
        stack), one per connection, made on the background loop."""
        from durable_rollouts.contracts.client import connect, describe
        from durable_rollouts.errors import ConfigError

        conn = temporal.connection()
        if conn not in self._clients:
            try:
                where = describe(conn)  # a profile or certificate file that cannot be read
            except ConfigError as e:
                raise CoreError(_one_line(str(e))) from e
            try:
                client = self._run(connect(conn))
            except Exception as e:
                msg = f"cannot reach Temporal at {where} ({e}); is the stack up?"
                raise CoreError(_one_line(msg)) from e
            self._clients.setdefault(conn, client)
        return self._clients[conn]

    def _config(self, config: str | Path | None, overrides: list[str]) -> Config:
        from durable_rollouts.config.load import load_config
        from durable_rollouts.config.paths import resolve_path

        cfg = load_config(config or None, overrides)  # a file, a PACKAGE:RELATIVE resource or a bundled name
        path = resolve_path(cfg.run.task_file, "run.task_file")
        return cfg.model_copy(update={"run": cfg.run.model_copy(update={"task_file": str(path)})})

    def alive(self) -> bool:
        """Not closed, and its event loop thread (once started) still running."""
        return not self._closed and (self._loop is None or self._loop.thread.is_alive())

    def close(self) -> None:
        """Stop the background event loop (by its thread) and close the store's connections; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stop_loop is not None:
            self._stop_loop()
        self._clients.clear()
        self._runs.clear()
        with contextlib.suppress(Exception):
            self.store.close()

    def __enter__(self) -> Core:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations ----------------------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        """Where the core was imported from and which store this handle uses."""
        from durable_rollouts import store

        with self._op("hello"):
            return {"core": str(Path(store.__file__ or "").parent.parent), "store": self.store.location}

    def policies(self) -> list[dict[str, Any]]:
        """The store's policy versions, in publish order."""
        with self._op("policies"):
            return self.store.policies()

    def settings(self, config: str | Path | None, overrides: list[str]) -> Settings:
        """The run config (its sampling settings and engines) and its tasks."""
        from durable_rollouts.environments.tasks import load_tasks

        with self._op("settings"):
            cfg = self._config(config, overrides)
            return Settings(cfg, load_tasks(cfg.run.task_file, cfg.run.env, cfg.sandbox))

    def start_run(
        self,
        config: str | Path | None,
        overrides: list[str],
        run_id: str,
        tasks: list[dict[str, Any]] | None = None,
    ) -> str:
        """Start the run (``rollouts run``'s way: on its environment's queue, tasks uploaded once a worker
        polls it); attach when it exists. ``tasks``: these tasks instead of the task file's."""
        with self._op("start_run"):
            from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

            from durable_rollouts.config.load import config_hash
            from durable_rollouts.contracts.types import RunInput
            from durable_rollouts.environments.fleet import require_worker
            from durable_rollouts.environments.tasks import load_tasks
            from durable_rollouts.workflows.run import RunWorkflow

            cfg = self._config(config, overrides)
            client = self._client(cfg.temporal)
            rows = tasks if tasks is not None else load_tasks(cfg.run.task_file, cfg.run.env, cfg.sandbox)

            async def go() -> Any:
                queue = await require_worker(client, cfg.temporal.task_queue, cfg.run.env)
                self.store.put_tasks(run_id, rows)
                return await client.start_workflow(
                    RunWorkflow.run,
                    RunInput(run_id=run_id, config=cfg, config_hash=config_hash(cfg)),
                    id=run_id,
                    task_queue=queue,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                )

            self._runs[run_id] = self._run(go())
            return run_id

    def _handle(self, run_id: str) -> Any:
        handle = self._runs.get(run_id)
        if handle is None:
            raise CoreError(f"run {run_id}: not started by this core handle")
        return handle

    def run_state(self, run_id: str) -> dict[str, Any]:
        """``{"running": bool, "status": ...}`` of a run this handle started."""
        with self._op("run_state"):
            desc = self._run(self._handle(run_id).describe())
            status = desc.status.name if desc.status is not None else "UNKNOWN"
            return {"running": status == "RUNNING", "status": status}

    def wait_run(self, run_id: str, timeout_s: float) -> str:
        """Wait until a run this handle started has ended (its result, or its failure as CoreError)."""
        with self._op("wait_run"):
            handle = self._handle(run_id)
            try:
                self._run(asyncio.wait_for(handle.result(), timeout_s))
            except TimeoutError:
                raise CoreError(f"run {run_id} did not finish within {timeout_s:.0f} s") from None
            return run_id

    def records(self, run_id: str) -> list[dict[str, Any]]:
        """Every record of the run in the export format (rollouts, then groups)."""
        from durable_rollouts.records.export import iter_run

        with self._op("records"):
            return list(iter_run(self.store, run_id))

    def take(
        self, run_id: str, n: int, current: str, max_lag: int, drop_zero_variance: bool, logprob_mode: str
    ) -> Batch:
        """One :meth:`TrainerFeed.take` of the run's feed for the trainer's ``current`` version."""
        from durable_rollouts.trainer.feed import TrainerFeed

        with self._op("take"):
            return TrainerFeed(self.store, run_id).take(n, current, max_lag, drop_zero_variance, logprob_mode)

    def put_evidence(self, run_id: str, batch_id: str, record: dict[str, Any]) -> bool:
        """Keep a consumed batch's off-policy evidence with the run (the run report shows it)."""
        with self._op("put_evidence"):
            return self.store.put_offpolicy_evidence(run_id, batch_id, record)

    def ledger(self, run_id: str) -> Ledger:
        """The run's books (``TrainerFeed.ledger``)."""
        from durable_rollouts.trainer.feed import TrainerFeed

        with self._op("ledger"):
            return TrainerFeed(self.store, run_id).ledger()

    def engine_versions(self, urls: list[str]) -> dict[str, str]:
        """The weight version each engine reports serving (``/weight_info``)."""
        import httpx

        with self._op("engine_versions"):
            return {
                u: str(httpx.get(f"{u.rstrip('/')}/weight_info", timeout=10).json()["weight_version"])
                for u in urls
            }

    def evaluate(
        self, config: str | Path | None, overrides: list[str], samples_per_task: int, seed: int
    ) -> EvalResult:
        """Accuracy on the run's tasks through its first engine at the run's sampling settings
        (``trainer.evaluate.accuracy``)."""
        from durable_rollouts.contracts.types import SamplingParams
        from durable_rollouts.environments import registry
        from durable_rollouts.environments.tasks import load_tasks
        from durable_rollouts.trainer.evaluate import accuracy

        with self._op("evaluate"):
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
            tasks = load_tasks(cfg.run.task_file, cfg.run.env, cfg.sandbox)
            env = registry.get(cfg.run.env)
            return self._run(
                accuracy(cfg.engine.urls[0], cfg.engine.model, env, tasks, sampling, samples_per_task, seed)
            )

    def publish(self, urls: list[str], version: str, weights_dir: str | Path) -> dict[str, Any]:
        """Publish ``weights_dir`` as ``version`` to every engine (``engines.policy.publish``)."""
        from durable_rollouts.engines.policy import publish

        with self._op("publish"):
            t0 = time.monotonic()
            rec = publish(urls, version, Path(weights_dir), self.store)
            return {"version": rec.version, "seq": rec.seq, "seconds": round(time.monotonic() - t0, 3)}
