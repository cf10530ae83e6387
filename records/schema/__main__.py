"""Write (or with --check, verify) the committed JSON Schemas from the record models."""

from __future__ import annotations

import sys

from durable_rollouts.records.record import RECORDS, SCHEMA_DIR, schema_text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for kind in RECORDS:
        path = SCHEMA_DIR / f"{kind}.json"
        text = schema_text(kind)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not check:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if check else 'wrote'} {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
