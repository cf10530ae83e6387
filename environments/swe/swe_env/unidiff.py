"""Unified diffs (``git diff`` / ``diff -u`` output, paths with ``a/`` ``b/`` prefixes): parse and apply.

SWE-bench rows carry their fix (``patch``) and their tests (``test_patch``) as unified diffs, and the
sandbox image has neither ``git`` nor ``patch``: this file is both a module (the host parses a row's diffs
to validate them and to learn which files they touch) and a standalone script, sent into the sandbox and
run there as ``python3 unidiff.py ROOT < PATCH`` (stdlib only, so any ``python3`` in an image runs it).

Applying: each hunk's removed and context lines must match the file, at the hunk's line or the nearest
line where they do (like ``patch`` without fuzz); new files (``--- /dev/null``) are created, deleted ones
(``+++ /dev/null``) removed; ``\\ No newline at end of file`` is honoured. Any mismatch fails the whole
patch before a file is written. Binary diffs are refused.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """The text is not a unified diff this module can apply, or it does not apply."""


@dataclass
class Hunk:
    old_start: int
    lines: list[tuple[str, str]] = field(default_factory=list)
    """(tag, text with its line ending): tag ' ' context, '-' removed, '+' added."""


@dataclass
class FilePatch:
    old: str | None
    """Path before (None: the file is created)."""
    new: str | None
    """Path after (None: the file is deleted)."""
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new if self.new is not None else self.old  # type: ignore[return-value]


def parse(text: str) -> list[FilePatch]:
    """The file patches of a unified diff.

    Raises:
        PatchError: no file patch, a binary diff, a malformed header or hunk, or an unsafe path.
    """
    lines = text.splitlines(keepends=True)
    out: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("GIT binary patch") or line.startswith("Binary files "):
            raise PatchError("binary diffs are not supported")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            fp = FilePatch(old=_path(line[4:]), new=_path(lines[i + 1][4:]))
            if fp.old is None and fp.new is None:
                raise PatchError(f"line {i + 1}: both sides are /dev/null")
            out.append(fp)
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not out:
                raise PatchError(f"line {i + 1}: a hunk before any '---'/'+++' header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(old_start=int(m.group(1)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                body = lines[i]
                tag = body[:1]
                if body.startswith("\\"):  # "\ No newline at end of file" of the line before
                    i += 1
                    continue
                if tag not in (" ", "-", "+"):
                    if body in ("\n", "\r\n"):  # an empty context line whose leading space was lost
                        tag, body = " ", " " + body
                    else:
                        raise PatchError(f"line {i + 1}: hunk ends early ({body[:40]!r})")
                hunk.lines.append((tag, body[1:]))
                seen_old += tag != "+"
                seen_new += tag != "-"
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise PatchError(f"line {i}: hunk counts do not match its header")
            if i < len(lines) and lines[i].startswith("\\"):
                tag, body = hunk.lines[-1]
                hunk.lines[-1] = (tag, body.rstrip("\r\n"))
                i += 1
            out[-1].hunks.append(hunk)
            continue
        if line.startswith("\\") and out and out[-1].hunks:
            tag, body = out[-1].hunks[-1].lines[-1]
            out[-1].hunks[-1].lines[-1] = (tag, body.rstrip("\r\n"))
        i += 1
    if not out:
        raise PatchError("no '---'/'+++' file header: not a unified diff")
    return out


def touched(text: str) -> list[str]:
    """Every path a diff reads or writes (relative, prefixes stripped), in order, once each."""
    seen: dict[str, None] = {}
    for fp in parse(text):
        for p in (fp.old, fp.new):
            if p is not None:
                seen[p] = None
    return list(seen)


def apply(root: str, text: str) -> list[str]:
    """Apply a diff under ``root``; returns the paths written or removed. All or nothing.

    Raises:
        PatchError: it does not parse, or a hunk does not match.
    """
    results: list[tuple[FilePatch, list[str] | None]] = []
    for fp in parse(text):
        lines: list[str] = []
        if fp.old is not None:
            src = os.path.join(root, fp.old)
            if not os.path.isfile(src):
                raise PatchError(f"{fp.old}: no such file to patch")
            with open(src, encoding="utf-8", newline="") as f:
                lines = f.read().splitlines(keepends=True)
        elif os.path.exists(os.path.join(root, fp.path)):
            raise PatchError(f"{fp.path}: the diff creates it, but it exists")
        results.append((fp, None if fp.new is None else _patched(fp, lines)))
    for fp, new_lines in results:
        if fp.old is not None and (fp.new is None or fp.new != fp.old):
            os.remove(os.path.join(root, fp.old))
        if new_lines is not None and fp.new is not None:
            dst = os.path.join(root, fp.new)
            os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
            with open(dst, "w", encoding="utf-8", newline="") as f:
                f.write("".join(new_lines))
    return [fp.path for fp, _ in results]


def _patched(fp: FilePatch, lines: list[str]) -> list[str]:
    out = list(lines)
    shift = 0
    for n, hunk in enumerate(fp.hunks, start=1):
        old = [body for tag, body in hunk.lines if tag != "+"]
        new = [body for tag, body in hunk.lines if tag != "-"]
        want = max(hunk.old_start - 1 + shift, 0) if old else min(hunk.old_start + shift, len(out))
        at = _find(out, old, want)
        if at is None:
            raise PatchError(f"{fp.path}: hunk {n} (line {hunk.old_start}) does not match")
        out[at : at + len(old)] = new
        shift += len(new) - len(old)
    return out


def _find(lines: list[str], old: list[str], want: int) -> int | None:
    """The start nearest ``want`` where ``old`` matches ``lines`` (line endings compared loosely)."""
    norm = [x.rstrip("\r\n") for x in old]
    for delta in range(len(lines) + 1):
        for at in (want - delta, want + delta) if delta else (want,):
            if 0 <= at <= len(lines) - len(old) and all(
                lines[at + k].rstrip("\r\n") == norm[k] for k in range(len(old))
            ):
                return at
    return None


def _path(header: str) -> str | None:
    name = header.rstrip("\r\n").split("\t", 1)[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith('"'):
        raise PatchError(f"quoted path {name} is not supported")
    if name[:2] in ("a/", "b/"):
        name = name[2:]
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise PatchError(f"unsafe path {name!r} in a diff header")
    return name


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 unidiff.py ROOT < PATCH", file=sys.stderr)
        return 2
    try:
        for path in apply(argv[1], sys.stdin.read()):
            print(f"patched {path}")
    except (PatchError, OSError, UnicodeDecodeError) as e:
        print(f"patch failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
