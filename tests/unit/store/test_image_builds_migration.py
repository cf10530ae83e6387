"""Schema 9 (images from a registry): a store of schema 8 with image builds in it gains the ``pushed_to``
and ``digest`` columns; its rows stay as they were (per host, no digest); a registry's row works beside
them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from durable_rollouts.sandboxes.images import ImageBuilds, registry_key
from durable_rollouts.store import RunStore
from durable_rollouts.store.schema import BASE, MIGRATIONS, SCHEMA_VERSION


def test_a_store_of_schema_8_keeps_its_image_builds_and_records_digests_after_migrating(
    tmp_path: Path,
) -> None:
    old = sqlite3.connect(tmp_path / "store.sqlite")  # as the release before schema 9 wrote it
    old.executescript(
        BASE + "".join(ddl for version, ddl in MIGRATIONS if version <= 8) + "PRAGMA user_version=8;"
    )
    old.execute(
        "INSERT INTO image_builds"
        " (host, tag, state, owner, builds, what, started_at, beat_at, finished_at, log)"
        " VALUES ('h1', 'dr-harbor-env:ab', 'built', 'r1', 1, 'task t', 1.0, 2.0, 3.0, 'Successfully built')"
    )
    old.commit()
    old.close()

    store = RunStore(tmp_path)
    assert store.schema_version() == SCHEMA_VERSION >= 9
    builds = ImageBuilds(store.db)
    row = builds.get("h1", "dr-harbor-env:ab")
    assert row is not None and (row["state"], row["builds"], row["pushed_to"], row["digest"]) == (
        "built",
        1,
        None,
        None,
    )
    assert builds.claim("h1", "dr-harbor-env:ab", "r2", "task t", looked_at=2.0, now=10.0) == ("built", "")

    key = registry_key("127.0.0.1:5000/dr")
    assert builds.claim(key, "dr-harbor-env:ab", "r3", "task t", 0.0, shared=True)[0] == "build"
    builds.finish(
        key,
        "dr-harbor-env:ab",
        "r3",
        True,
        "log",
        None,
        "127.0.0.1:5000/dr/dr-harbor-env",
        "sha256:" + "1" * 64,
    )
    assert builds.claim(key, "dr-harbor-env:ab", "r4", "task t", 0.0, shared=True) == (
        "pull",
        "127.0.0.1:5000/dr/dr-harbor-env@sha256:" + "1" * 64,
    )
    assert builds.builds("dr-harbor-env:ab") == 2
