"""Files a harness leaves in its sandbox, kept with the rollout (`HarnessCommand.keep`): read wherever they
lie (through a copy under the workdir, removed after), stored once per (rollout, path) on either store
backend, and a missing one kept as its reason."""

from __future__ import annotations

import pytest

from durable_rollouts.errors import SandboxFileError, SandboxPathError
from durable_rollouts.gateway.harness import read_kept
from durable_rollouts.sandboxes.base import ExecResult
from durable_rollouts.store import RunStore


class CopyingSandbox:
    """A shell of ``cp``/``rm`` over dicts: files anywhere, a workdir whose reader refuses absolute paths."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.anywhere = dict(files)
        self.workdir: dict[str, bytes] = {}

    async def exec(self, cmd: str, timeout_s: float | None = None, once_key: str | None = None) -> ExecResult:
        words = cmd.split()
        if words[0] == "cp":
            src, dst = words[2].strip("'"), words[3]
            if src not in self.anywhere:
                return ExecResult(exit_code=1, output=f"cp: cannot stat '{src}': No such file or directory")
            self.workdir[dst] = self.anywhere[src]
            return ExecResult(exit_code=0, output="")
        assert words[:3] == ["rm", "-f", "--"], cmd
        self.workdir.pop(words[3], None)
        return ExecResult(exit_code=0, output="")

    async def write_file(self, path: str, content: bytes | str) -> None:
        raise AssertionError("nothing is written")

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        if path.startswith("/"):
            raise SandboxPathError(f"rejected path {path!r}: absolute")
        data = self.workdir[path]
        if len(data) > max_bytes:
            raise SandboxFileError(f"read {path!r}: file is larger than max_bytes={max_bytes}")
        return data


async def test_a_file_anywhere_in_the_sandbox_is_read_and_its_copy_removed() -> None:
    box = CopyingSandbox({"/tmp/.dr-harness/trajectory.json": b'{"messages": []}'})
    assert await read_kept(box, "/tmp/.dr-harness/trajectory.json") == b'{"messages": []}'
    assert box.workdir == {}  # the copy under the workdir is gone: the verifier never sees it
    with pytest.raises(SandboxFileError, match="No such file"):
        await read_kept(box, "/tmp/missing.json")
    box.anywhere["/big"] = b"x" * 11
    with pytest.raises(SandboxFileError, match="larger than max_bytes=10"):
        await read_kept(box, "/big", max_bytes=10)
    assert box.workdir == {}


def test_kept_files_are_written_once_per_rollout_and_path(any_store: RunStore) -> None:
    rid = "run/g0/0"
    any_store.keep_harness_file(rid, "/tmp/t.json", b"\x00first", None)
    any_store.keep_harness_file(rid, "/tmp/t.json", b"second", None)  # a retried activity: the first stands
    any_store.keep_harness_file(rid, "/tmp/gone.json", None, "keep '/tmp/gone.json': no such file")
    any_store.keep_harness_file("run/g0/1", "/tmp/t.json", b"other", None)
    assert any_store.harness_files(rid) == {
        "/tmp/gone.json": "keep '/tmp/gone.json': no such file",
        "/tmp/t.json": b"\x00first",
    }
    assert any_store.harness_files("run/g0/2") == {}
