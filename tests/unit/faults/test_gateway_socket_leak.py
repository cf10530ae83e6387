"""A SIGKILLed worker leaves its rollout's gateway socket file behind (its ``finally`` never runs); the
harness activity's retry that finds no sandbox fails (SandboxGone) and removes that file, so the ledger
finds no leaked socket once the rollout has ended (the 30-minute chaos soak's one leak)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from durable_rollouts.activities.harness import HarnessActivities
from durable_rollouts.contracts.harness import HarnessRunInput
from durable_rollouts.contracts.ref import RolloutRef
from durable_rollouts.faults.ledger import check_sockets
from durable_rollouts.gateway.server import SOCKET_NAME, GatewayServer
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV, gateway_dir
from durable_rollouts.store import RunStore

RID = "leak-run/g000000/1"


class _NoSandbox:
    """The sandbox activities of a worker whose rollout's sandbox is gone (its host lost it)."""

    async def bound(self, rollout_id: str) -> None:
        return None


async def test_a_retry_without_a_sandbox_removes_the_dead_workers_socket_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    folder = Path(gateway_dir(RID))
    folder.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX)  # bound, then closed: the file a killed process leaves
    dead.bind(str(folder / SOCKET_NAME))
    dead.close()
    assert [v.rule for v in check_sockets([RID])] == ["leaked-socket"]
    store = RunStore(tmp_path / "store")
    acts = HarnessActivities(store, None, _NoSandbox(), GatewayServer(store))  # type: ignore[arg-type]
    ref = RolloutRef(run_id="leak-run", group_id="g000000", rollout_id=RID, task_id="t", sample_index=1,
                     env="mini-swe-agent", model="tiny")  # fmt: skip
    with pytest.raises(ApplicationError, match="no sandbox to run the harness in") as err:
        await acts.harness_run(HarnessRunInput(ref=ref))
    assert err.value.type == "SandboxGone"
    assert check_sockets([RID]) == []
