"""Gateway call requests stored as deltas against the previous call (store/gateway_calls.py), on both
backends (the ``store_url`` fixture of tests/postgres.py): each row keeps only what is new, every read returns
the request whole, rows written whole before deltas still read."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from durable_rollouts.store import RunStore, open_store
from durable_rollouts.store.gateway_calls import DELTA, apply_delta

RID = "run/g000000/0"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@pytest.fixture
def stores(store_url: str) -> Iterator[Callable[[], RunStore]]:
    """Store objects on one store, each with nothing kept (as other workers' would be), closed at the end."""
    opened: list[RunStore] = []

    def new() -> RunStore:
        opened.append(open_store(store_url))
        return opened[-1]

    yield new
    for s in opened:
        s.close()


def conversation(n: int) -> list[list[dict[str, Any]]]:
    """The requests of an agent's ``n`` calls: each one the previous plus its answer and an observation."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "sys " * 50},
        {"role": "user", "content": "go"},
    ]
    out = [list(msgs)]
    for i in range(1, n):
        msgs += [{"role": "assistant", "content": f"step {i}"}, {"role": "user", "content": f"obs {i} " * 20}]
        out.append(list(msgs))
    return out


def stored_requests(store: RunStore) -> list[dict[str, Any]]:
    rows = store.db.execute("SELECT request_json FROM gateway_calls ORDER BY idx").fetchall()
    return [json.loads(r[0]) for r in rows]


def record(store: RunStore, requests: list[list[dict[str, Any]]], **extra: Any) -> None:
    for i, msgs in enumerate(requests):
        store.open_call(RID, f"k{i}", {"messages": msgs, "tools": TOOLS, **extra})
        store.answer_call(RID, i, 200, {"n": i}, {"raw": f"step {i + 1}"})


def test_requests_are_stored_as_deltas_and_read_back_whole(stores: Callable[[], RunStore]) -> None:
    requests = conversation(12)
    store = stores()
    record(store, requests, api="chat")
    rows = stored_requests(store)
    assert DELTA not in rows[0] and rows[0]["messages"] == requests[0]
    for i, row in enumerate(rows[1:], start=1):  # only the two new messages, the rest named
        assert row["messages"] == requests[i][-2:]
        assert row[DELTA] == {
            "of": i - 1,
            "key": f"k{i - 1}",
            "kept": len(requests[i - 1]),
            "same": ["api", "tools"],
        }
        assert "tools" not in row
    fresh = stores()  # another worker: nothing kept, every request rebuilt from the rows
    for s in (store, fresh):
        assert [c.request for c in s.gateway_calls(RID)] == [
            {"messages": m, "tools": TOOLS, "api": "chat"} for m in requests
        ]
    for i in (7, 3, 11, 0):  # out of order, with no kept request to start from
        call = stores().get_call(RID, i)
        assert call is not None and call.request == {"messages": requests[i], "tools": TOOLS, "api": "chat"}
    # The store's bytes grow with the conversation, not its square: the 12th row is as small as the 2nd.
    sizes = [len(json.dumps(r)) for r in rows]
    assert sizes[-1] < 1.2 * sizes[1] and sum(sizes) < 3 * len(json.dumps(requests[-1]))


def test_a_retry_a_rewrite_and_a_changed_field_are_rebuilt_exactly(stores: Callable[[], RunStore]) -> None:
    store = stores()
    requests = conversation(3)
    record(store, requests)
    again = store.open_call(RID, "k2", {"messages": requests[2], "tools": TOOLS})
    assert again.index == 2 and again.answered and again.request["messages"] == requests[2]
    for s in (store, stores()):  # a second answer (a retried activity's) leaves the first standing
        assert s.answer_call(RID, 2, 200, {"n": 99}, {}).response == {"n": 2}
    summary = [requests[0][0], {"role": "user", "content": "summary of the work so far"}]
    options = {"temperature": 1.0}
    store.open_call(RID, "k3", {"messages": summary, "tools": None, "options": options})
    row = stored_requests(store)[3]
    assert row[DELTA]["kept"] == 1 and row["messages"] == summary[1:] and row["tools"] is None
    want = {"messages": summary, "tools": None, "options": options}
    assert stores().get_call(RID, 3).request == want  # type: ignore[union-attr]
    assert store.get_call(RID, 3).request == want  # type: ignore[union-attr]


def test_the_callers_list_growing_after_the_call_changes_nothing_stored(
    stores: Callable[[], RunStore],
) -> None:
    store = stores()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    store.open_call(RID, "k0", {"messages": msgs})
    store.answer_call(RID, 0, 200, {}, {})
    msgs.append({"role": "assistant", "content": "a"})  # a harness client appends to its own list
    store.open_call(RID, "k1", {"messages": msgs})
    assert stored_requests(store)[1]["messages"] == [{"role": "assistant", "content": "a"}]
    assert stores().get_call(RID, 1).request["messages"] == msgs  # type: ignore[union-attr]


def test_rows_written_whole_before_deltas_still_read_and_take_deltas_after_them(
    stores: Callable[[], RunStore],
) -> None:
    store = stores()
    requests = conversation(4)
    for i, msgs in enumerate(requests[:2]):  # as the gateway wrote them before deltas: each request whole
        store.db.execute(
            "INSERT INTO gateway_calls (rollout_id, idx, request_key, request_json, status, response_json,"
            " detail_json, created_at) VALUES (?,?,?,?,?,?,?,?)",
            (RID, i, f"k{i}", json.dumps({"messages": msgs, "tools": TOOLS}), 200, "{}", "{}", time.time()),
        )
    reopened = stores()
    for i, msgs in enumerate(requests[2:], start=2):
        reopened.open_call(RID, f"k{i}", {"messages": msgs, "tools": TOOLS})
        reopened.answer_call(RID, i, 200, {}, {})
    rows = stored_requests(reopened)
    assert [DELTA in r for r in rows] == [False, False, True, True]
    assert [c.request["messages"] for c in stores().gateway_calls(RID)] == requests


def test_a_delta_read_against_another_call_is_refused_naming_the_rollout() -> None:
    stored = {"messages": [], DELTA: {"of": 4, "key": "abc", "kept": 0, "same": []}}
    with pytest.raises(ValueError, match=f"rollout {RID}: .* stored against call 4"):
        apply_delta(stored, 3, "abc", {"messages": []}, RID)
