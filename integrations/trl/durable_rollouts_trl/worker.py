"""A rollout worker for TRL's ``AsyncGRPOTrainer`` backed by a durable run and its trainer feed.

Pass one :class:`DurableRolloutWorker` as both ``rollout_worker=`` and ``weight_transfer=``: TRL 1.16's
``RolloutWorkerProtocol`` (``rollout_buffer``, ``metrics_queue``, ``start``, ``stop``,
``update_model_version``, ``check_health``) and ``WeightTransferProtocol`` (``init_weight_transfer``,
``pause``, ``send_weights``, ``resume``, ``destroy``).

Invariants:
- Samples come only from the trainer feed (``TrainerFeed.take`` in the core, through core.py): each
  group at most once, judged fresh against the version the trainer holds with ``max_lag`` = TRL's
  ``max_staleness``; zero-variance groups (with ``drop_zero_variance``) and stale ones are discarded with a
  reason and stay in the books; members without an advantage (infra failures) give no sample.
- Every TRL weight sync becomes a published policy version: ``send_weights`` writes the trainer's tensors as
  a complete checkpoint, ``update_model_version(n)`` publishes it to every engine as ``<prefix><n>`` through
  ``engines.policy.publish`` (pause keep, reload, set version, reset prefix cache, resume). So the versions
  the feed checks, and that every sampled token carries, are the trainer's.
- A sample's ``model_version`` is ``n - lag`` of its oldest sampled token (samples.py): TRL's staleness is
  the feed's lag, never larger than ``max_staleness`` when the feed hands the sample out.
- Off-policy evidence (offpolicy.py) is computed for every take, with the weights of the version the
  trainer holds (loaded from its published directory, a private copy: the training thread is never read
  from), and goes to ``metrics_queue`` (TRL logs it), :attr:`evidence` and the run store under the take's
  batch id (``rollouts report`` plots it; a repeated write of a batch changes nothing).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from durable_rollouts_trl.core import Core
from durable_rollouts_trl.samples import (
    WANTED_LOGPROBS,
    SampleError,
    Sampling,
    check_sampling,
    sample_fields,
    token_lags,
)

Named = Any  # Iterator[tuple[str, torch.Tensor]]


class DurableRolloutWorker:
    """Feeds ``AsyncGRPOTrainer`` from a durable run (see the module invariants)."""

    def __init__(
        self,
        config: str | Path | None,
        *,
        home: str | Path,
        run_id: str,
        max_staleness: int,
        sampling: Sampling | None = None,
        overrides: list[str] | None = None,
        store_url: str | None = None,
        groups_per_take: int = 4,
        drop_zero_variance: bool = True,
        weights_root: str | Path | None = None,
        version_prefix: str | None = None,
        start_run: bool = True,
        offpolicy: bool = True,
        poll_s: float = 0.5,
    ) -> None:
        self.config = str(config) if config else None
        self.overrides = list(overrides or [])
        self.home, self.store_url, self.run_id = Path(home), store_url, run_id
        self.max_staleness, self.sampling = max_staleness, sampling or Sampling()
        self.groups_per_take, self.drop_zero_variance = groups_per_take, drop_zero_variance
        self.weights_root = Path(weights_root) if weights_root else self.home / "policies"
        self.prefix = version_prefix or f"{run_id}-v"
        self.start_run, self.offpolicy, self.poll_s = start_run, offpolicy, poll_s
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.evidence: list[dict[str, Any]] = []
        self.published: list[dict[str, Any]] = []
        self.discarded: list[dict[str, Any]] = []
        self.consumed: list[dict[str, Any]] = []
        """One line per sample handed to TRL: rollout id, model_version, the trainer's version then, group."""
        self.current: str | None = None  # the version label the trainer holds
        self.current_int = 0
        self._core: Core | None = None
        self._urls: list[str] = []
        self._source: Path | None = None
        self._pending: tuple[int, str, Path] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._beat = time.monotonic()
        self._exhausted = False
        self._scorer: tuple[str, Any] | None = None

    # -- set-up ---------------------------------------------------------------------------------------
    def _ensure(self) -> Core:
        if self._core is None:
            self._core = Core(self.home, self.store_url)
            cfg = self._core.settings(self.config, self.overrides).config
            probe = {"rollout_id": f"run {self.run_id} [sampling]", "sampling": {
                **cfg.sampling.model_dump(mode="json"), "logprob_mode": cfg.engine.logprob_mode}}  # fmt: skip
            check_sampling(probe, self.sampling)
            self._urls = [u.rstrip("/") for u in cfg.engine.urls]
            versions = self._core.engine_versions(self._urls)
            if len(set(versions.values())) != 1:
                raise SampleError(f"engines serve different versions {versions}; publish one version to all")
            start = next(iter(versions.values()))
            row = self._row(start)
            if row is None or row["status"] != "published":
                raise SampleError(f"engines serve {start!r}, which the store never published")
            self.current, self._source = start, Path(row["weights_dir"])
        return self._core

    def _row(self, version: str) -> dict[str, Any] | None:
        assert self._core is not None
        return next((p for p in self._core.policies() if p["version"] == version), None)

    # -- WeightTransferProtocol -----------------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        self._ensure()

    def pause(self) -> None:  # publish() pauses and resumes every engine itself
        pass

    def resume(self) -> None:
        pass

    def send_weights(self, iterator: Named) -> None:
        """Write the trainer's tensors as the next version's checkpoint (published by the next update)."""
        from durable_rollouts_trl.weights import save_weights

        self._ensure()
        assert self._source is not None
        n = self.current_int + 1
        label = f"{self.prefix}{n}"
        out = save_weights(iterator, self._source, self.weights_root / label)
        self._pending = (n, label, out)

    def destroy(self) -> None:
        pass

    # -- RolloutWorkerProtocol ------------------------------------------------------------------------
    def update_model_version(self, model_version: int) -> None:
        core = self._ensure()
        if self._pending is None or self._pending[0] != model_version:
            raise SampleError(
                f"update_model_version({model_version}) without its weights: pass this worker as the "
                "trainer's weight_transfer too, so every version it names is published"
            )
        n, label, out = self._pending
        rec = core.publish(self._urls, label, out)
        self.published.append(rec)
        with self._lock:
            self.current, self.current_int, self._pending = label, n, None

    def start(self) -> None:
        core = self._ensure()
        if self.start_run:
            core.start_run(self.config, self.overrides, self.run_id)
        self._thread = threading.Thread(target=self._loop, name="durable-rollouts-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        if self._core is not None:
            self._core.close()
            self._core = None

    def check_health(self, stale_after_s: float) -> None:
        if self._error:
            raise RuntimeError(f"durable rollout worker failed: {self._error}")
        if self._core is None or not self._core.alive():
            raise RuntimeError("durable rollout worker: not started, or stopped (its core handle is closed)")
        if self._exhausted and self.rollout_buffer.empty():
            raise RuntimeError(f"run {self.run_id} ended and its feed holds nothing fresh: no more samples")
        if time.monotonic() - self._beat > stale_after_s:
            raise RuntimeError(f"durable rollout worker: no heartbeat for {stale_after_s:.0f} s")

    # -- the feed loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat = time.monotonic()
                if not self.take_once():
                    self._stop.wait(self.poll_s)
        except Exception as e:
            self._error = f"{type(e).__name__}: {e}"

    def take_once(self) -> int:
        """One take from the feed: enqueue its samples and its evidence; returns the groups consumed."""
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        core = self._ensure()
        with self._lock:
            current, current_int = self.current, self.current_int
        assert current is not None
        running = self.start_run and core.run_state(self.run_id)["running"]
        batch = core.take(self.run_id, self.groups_per_take, current, self.max_staleness,
                          self.drop_zero_variance, WANTED_LOGPROBS)  # fmt: skip
        self.discarded += [asdict(d) for d in batch.discarded]
        if not batch.groups:
            self._exhausted = self.start_run and not running
            return 0
        order = {p["version"]: i for i, p in enumerate(core.policies())}
        records = [r for g in batch.groups for r in g.rollouts]
        samples = []
        for rec in records:
            f = sample_fields(rec, order, current, current_int, self.sampling)
            if f is not None:
                samples.append((rec, f))
        ev: dict[str, Any] = {
            "current": current, "model_version": current_int, "groups": len(batch.groups),
            "samples": len(samples), "discarded": len(batch.discarded),
            "max_group_lag": max(g.lag for g in batch.groups),
        }  # fmt: skip
        if self.offpolicy and samples:
            from durable_rollouts_trl.offpolicy import evidence, metrics

            recs = [r for r, _ in samples]
            lags = [token_lags(r, order, current) for r in recs]
            ev.update(evidence(self._scorer_for(current), recs, self.sampling.temperature, lags))
            self.metrics_queue.put(metrics(ev))
        self.evidence.append(ev)
        assert batch.batch_id is not None  # the take marked groups, so it has a batch id
        core.put_evidence(self.run_id, batch.batch_id, ev)
        now = time.time()
        for rec, f in samples:
            self.consumed.append({
                "rollout_id": rec["rollout_id"], "model_version": f["model_version"],
                "current_int": current_int, "group_id": f["group_id"], "advantage": f["advantage"],
                "tokens": sum(f["completion_mask"]),
            })  # fmt: skip
            self.rollout_buffer.put(
                RolloutSample(
                    prompt=[],
                    completion=[],
                    input_ids=_np(f["input_ids"], "int64"),
                    completion_mask=_np(f["completion_mask"], "int64"),
                    old_log_probs=_np(f["old_log_probs"], "float32"),
                    advantage=f["advantage"],
                    model_version=f["model_version"],
                    group_id=f["group_id"],
                    metrics=f["metrics"],
                    enqueued_at=now,
                )
            )
        return len(batch.groups)

    def _scorer_for(self, version: str) -> Any:
        """A private copy of the weights of ``version`` (its published directory), cached per version."""
        if self._scorer is None or self._scorer[0] != version:
            import torch
            from transformers import AutoModelForCausalLM

            row = self._row(version)
            assert row is not None
            model = AutoModelForCausalLM.from_pretrained(row["weights_dir"], dtype=torch.float32)
            self._scorer = (version, model.eval())
        return self._scorer[1]

    def ledger(self) -> dict[str, Any]:
        """The run's books (generated = consumed + discarded + waiting), from the core's feed; also after
        :meth:`stop` (TRL stops its rollout worker when training ends), through a core handle of its own."""
        if self._core is not None and self._core.alive():
            led = self._core.ledger(self.run_id)
        else:
            with Core(self.home, self.store_url) as core:
                led = core.ledger(self.run_id)
        books = ("generated", "consumed", "discarded", "waiting")
        return {**{k: asdict(getattr(led, k)) for k in books}, "balanced": led.balanced}


def _np(values: list[Any], dtype: str) -> Any:
    import numpy as np

    return np.asarray(values, dtype=dtype)
