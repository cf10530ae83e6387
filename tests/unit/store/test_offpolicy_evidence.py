"""A trainer's off-policy evidence, kept per consumed batch on either store backend: the first report of a
batch stands (a retried report changes nothing), runs do not see each other's, order is the order kept."""

from __future__ import annotations

from durable_rollouts.store import RunStore


def test_evidence_is_kept_once_per_batch_in_order(any_store: RunStore) -> None:
    first = {"step": 1, "mean_abs_dlogp": 0.004, "flagged": False}
    assert any_store.put_offpolicy_evidence("run-a", "b000001", first)
    assert not any_store.put_offpolicy_evidence("run-a", "b000001", {"step": 1, "mean_abs_dlogp": 9.0})
    assert any_store.put_offpolicy_evidence("run-a", "b000002", {"step": 2, "flagged": True})
    assert any_store.put_offpolicy_evidence("run-b", "b000001", {"step": 7})

    kept = any_store.offpolicy_evidence("run-a")
    assert [(e["batch_id"], e["step"]) for e in kept] == [("b000001", 1), ("b000002", 2)]
    assert kept[0]["mean_abs_dlogp"] == 0.004 and kept[1]["flagged"] is True
    assert kept[0]["at"] <= kept[1]["at"]
    assert [e["step"] for e in any_store.offpolicy_evidence("run-b")] == [7]
    assert any_store.offpolicy_evidence("run-c") == []
