"""``rollout_func`` for TRL's synchronous ``GRPOTrainer``: every call runs its prompts through the pipeline.

``GRPOTrainer`` (TRL >= 0.25) calls ``rollout_func(prompts, trainer)`` with each prompt repeated
``num_generations`` times in a row and expects ``prompt_ids``, ``completion_ids`` and ``logprobs`` per
entry; other keys reach the reward functions, ``env_mask`` masks tokens out of the loss.

Invariants:
- Every call is durable: before sampling, the trainer's current weights are published to every engine as
  ``<prefix><global_step>`` (once per step), then one run is started with one group of ``num_generations``
  per distinct prompt (the task whose prompt it is, from the run's task file), and the call returns only
  when that run has ended; its records stay in the store under ``<prefix>-s<step>-c<call>``.
- The returned tokens are the records' own (never re-tokenized): ``prompt_ids`` up to the first sampled
  token, the rest as ``completion_ids`` with ``env_mask`` = its loss mask (observation tokens 0), the
  behaviour logprobs (0.0 on observations), and ``reward`` from the environment's verifier (pass
  :func:`durable_reward` as a reward function). A member that failed (no reward) is fully masked and given
  its group's mean reward, so it neither trains nor shifts its group's mean.
- Off-policy evidence (offpolicy.py) of each call's records against the trainer's model is logged in the
  trainer's metrics (``offpolicy/*``), kept in :attr:`DurableRolloutFunc.evidence` and in the run store
  with the call's run (``rollouts report`` plots it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from durable_rollouts_trl.core import Core
from durable_rollouts_trl.samples import Sampling, check_sampling, rollout_func_row, token_lags


class RolloutFuncError(RuntimeError):
    """The prompts cannot be run as asked (one line)."""


def durable_reward(prompts: list[Any], completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    """The environment's reward of each completion, as the pipeline's verifier scored it."""
    return [float(r) for r in reward]


class DurableRolloutFunc:
    """Callable ``rollout_func`` over a run config (its engines, environment, sampling and task file)."""

    def __init__(
        self,
        config: str | Path | None,
        *,
        home: str | Path,
        prefix: str,
        overrides: list[str] | None = None,
        store_url: str | None = None,
        weights_root: str | Path | None = None,
        timeout_s: float = 600.0,
        offpolicy: bool = True,
    ) -> None:
        self.config = str(config) if config else None
        self.overrides = list(overrides or [])
        self.home, self.prefix, self.timeout_s, self.offpolicy = Path(home), prefix, timeout_s, offpolicy
        self.weights_root = Path(weights_root) if weights_root else self.home / "policies"
        self.core = Core(self.home, store_url)
        st = self.core.settings(self.config, self.overrides)
        self.run_config = st.config
        self.tasks = st.tasks
        self.by_prompt: dict[str, dict[str, Any]] = {}
        for t in self.tasks:
            self.by_prompt.setdefault(str(t.get("prompt", t["id"])), t)
        self.urls = [u.rstrip("/") for u in self.run_config.engine.urls]
        self.calls = 0
        self.published: dict[int, str] = {}
        self.evidence: list[dict[str, Any]] = []
        self.run_ids: list[str] = []

    def prompts(self) -> list[str]:
        """The task file's prompts, in order: a dataset ``{"prompt": ...}`` for the trainer."""
        return list(self.by_prompt)

    def close(self) -> None:
        """Close the core handle (its event loop thread, the store's connections)."""
        self.core.close()

    # -- the call ------------------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        g = int(trainer.num_generations)
        if len(prompts) % g:
            raise RolloutFuncError(f"{len(prompts)} prompts is not a multiple of num_generations {g}")
        groups = [prompts[i : i + g] for i in range(0, len(prompts), g)]
        tasks = []
        for grp in groups:
            if any(p != grp[0] for p in grp):
                raise RolloutFuncError("prompts do not come in runs of num_generations identical prompts")
            key = grp[0] if isinstance(grp[0], str) else str(grp[0])
            if key not in self.by_prompt:
                raise RolloutFuncError(f"prompt {key[:60]!r} is not a task of the run's task file")
            tasks.append(self.by_prompt[key])
        sampling = Sampling(
            float(trainer.temperature), float(trainer.args.top_p), int(trainer.args.top_k or 0)
        )
        version = self._publish(trainer)
        self.calls += 1
        run_id = f"{self.prefix}-s{trainer.state.global_step:06d}-c{self.calls:04d}"
        over = [*self.overrides, f"run.num_groups={len(tasks)}", f"run.group_size={g}"]
        self.core.start_run(self.config, over, run_id, tasks=tasks)
        self.core.wait_run(run_id, self.timeout_s)
        self.run_ids.append(run_id)
        lines = self.core.records(run_id)
        recs = sorted(
            (r for r in lines if r["kind"] == "rollout"), key=lambda r: (r["group_id"], r["sample_index"])
        )
        if len(recs) != len(prompts):
            raise RolloutFuncError(f"run {run_id}: {len(recs)} records for {len(prompts)} prompts")
        keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "reward", "durable_rollout_id")
        out: dict[str, list[Any]] = {k: [] for k in keys}
        for i in range(len(groups)):
            members = recs[i * g : (i + 1) * g]
            scored = [
                float(r["reward"]) for r in members if r.get("reward") is not None and r.get("scorable")
            ]
            mean = sum(scored) / len(scored) if scored else 0.0
            for r in members:
                ok = r.get("reward") is not None and r.get("scorable")
                if ok:
                    check_sampling(r, sampling)
                row = rollout_func_row(r)
                if not ok:
                    row["env_mask"] = [0] * len(row["env_mask"])
                for k, v in row.items():
                    out[k].append(v)
                out["reward"].append(float(r["reward"]) if ok else mean)
                out["durable_rollout_id"].append(r["rollout_id"])
        if self.offpolicy:
            self._evidence(trainer, recs, version, sampling.temperature, run_id)
        return out

    def _publish(self, trainer: Any) -> str:
        """Publish the trainer's weights of this step (once per step); returns the version label."""
        from durable_rollouts_trl.weights import save_weights

        step = int(trainer.state.global_step)
        if step not in self.published:
            label = f"{self.prefix}{step}"
            rows = self.core.policies()
            source = Path(rows[0]["weights_dir"]) if rows else None
            versions = self.core.engine_versions(self.urls)
            row = next((p for p in rows if p["version"] in set(versions.values())), None)
            source = Path(row["weights_dir"]) if row else source
            if source is None:
                raise RolloutFuncError("the store has no published version; start the stack (it records v0)")
            model = trainer.accelerator.unwrap_model(trainer.model)
            out = save_weights(model.state_dict().items(), source, self.weights_root / label)
            self.core.publish(self.urls, label, out)
            self.published[step] = label
        return self.published[step]

    def _evidence(
        self, trainer: Any, recs: list[dict[str, Any]], version: str, temperature: float, run_id: str
    ) -> None:
        from durable_rollouts_trl.offpolicy import evidence, metrics

        order = {p["version"]: i for i, p in enumerate(self.core.policies())}
        usable = [r for r in recs if any(r["loss_mask"])]
        lags = [token_lags(r, order, version) for r in usable]
        model = trainer.accelerator.unwrap_model(trainer.model)
        ev = {"run_id": run_id, "current": version, "step": int(trainer.state.global_step),
              **evidence(model, usable, temperature, lags)}  # fmt: skip
        self.evidence.append(ev)
        # one run per call, its records consumed whole: the call's batch is the run's only one
        self.core.put_evidence(run_id, "rollout_func", ev)
        sink = getattr(trainer, "_metrics", {}).get("train")
        if sink is not None:
            for k, v in metrics(ev).items():
                sink[k].append(v)


def make_rollout_func(config: str | Path | None, **kwargs: Any) -> DurableRolloutFunc:
    """A ``rollout_func`` for ``GRPOTrainer(rollout_func=...)``; see :class:`DurableRolloutFunc`."""
    return DurableRolloutFunc(config, **kwargs)
