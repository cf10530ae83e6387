"""The reaper keeps a rollout's further sandboxes (``<rollout id>#<name>``) exactly while it keeps the
rollout's own: their workflow is the rollout's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from temporalio.client import WorkflowExecutionStatus

from durable_rollouts.sandboxes.base import SandboxInfo, owner_key, sibling_key
from durable_rollouts.sandboxes.reaper import reap_orphans

RUNNING, ENDED = "run/g0/0", "run/g1/0"


class Client:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def get_workflow_handle(self, workflow_id: str) -> Any:
        self.asked.append(workflow_id)
        status = (
            WorkflowExecutionStatus.RUNNING if workflow_id == RUNNING else WorkflowExecutionStatus.COMPLETED
        )

        async def describe() -> Any:
            return SimpleNamespace(status=status)

        return SimpleNamespace(describe=describe)


class Backend:
    def __init__(self, keys: list[str]) -> None:
        self.infos = [SandboxInfo(name=k, container_id=k, key=k, run_id="run", state="running", created_at=0)
                      for k in keys]  # fmt: skip
        self.kept: set[str] = set()

    async def list_containers(self, run_id: str | None = None) -> list[SandboxInfo]:
        return self.infos

    async def reap(
        self, run_id: str | None = None, older_than_s: float | None = None, keep: Any = ()
    ) -> list:
        self.kept = set(keep)
        return [i.name for i in self.infos if i.key not in keep]


async def test_siblings_live_and_die_with_their_rollout() -> None:
    keys = [RUNNING, sibling_key(RUNNING, "verifier"), ENDED, sibling_key(ENDED, "verifier")]
    client, backend = Client(), Backend(keys)
    removed = await reap_orphans(client, backend, min_age_s=0)  # type: ignore[arg-type]
    assert backend.kept == {RUNNING, sibling_key(RUNNING, "verifier")}
    assert set(removed) == {ENDED, sibling_key(ENDED, "verifier")}
    assert set(client.asked) == {RUNNING, ENDED}  # a sibling's key is never taken for a workflow id
    assert owner_key(sibling_key(RUNNING, "verifier")) == owner_key(RUNNING) == RUNNING
