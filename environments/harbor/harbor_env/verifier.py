"""The verifier as Harbor runs it, in the rollout's sandbox (Harbor's ``harbor/verifier/verifier.py``).

After the agent's last turn: the stale reward files are removed, ``tests/`` is copied to ``/tests``,
``/tests/test.sh`` is made executable and run with its output to ``/logs/verifier/test-stdout.txt``, under
``[verifier].timeout_sec`` and with ``[verifier].env``; then the reward is read by Harbor's rule:
``/logs/verifier/reward.json`` if it exists (a flat dict of finite numbers), else ``reward.txt`` (one
finite float, as ``{"reward": value}``). An empty, unparsable or missing reward file, or a verifier past
its timeout, is Harbor's verifier error: here `EnvironmentFailure`, never a reward of 0. The copy and the
run are keyed execs (``once``): a retried score does not run the verifier a second time in one sandbox.

The rollout's reward is the ``reward`` key; a dict without it scores the mean of its values (Harbor keeps
per-key means). Every key is kept as the scored turn's ``metrics``.
"""

from __future__ import annotations

import base64
import io
import json
import math
import secrets
import shlex
import tarfile

from durable_rollouts.environments.base import Sandbox, Score
from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes.base import ExecResult

REWARD_MARK = "harbor-reward-file: "
TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
GRACE_S = 5.0
"""Added to the verifier's timeout for the command around it (copy, chmod)."""


def tests_tar(files: dict[str, bytes], executables: set[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if path in executables else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def verify(
    box: Sandbox, task_id: str, tests: dict[str, bytes], executables: set[str], timeout_s: float,
    env: dict[str, str], once: str | None = None, user: str | None = None, upload: bool = True,
) -> Score:  # fmt: skip
    """Run ``tests`` (``tests/`` of the task, relative paths) as Harbor's verifier does; the reward.

    With ``once`` (an exec key scope, e.g. ``score-N``), the copy and the verifier run once per sandbox: a
    retry (its worker died mid-verifier) waits for the first run and reads its reward. ``user``: who the
    copy and the tests run as (``[verifier].user``; None: the sandbox's user). The upload of the tests is
    written and removed as the sandbox's user, who owns the working directory. ``upload=False``: the
    sandbox's image holds ``/tests`` already (a separate verifier's own image: Harbor's bundled tests)."""
    prepare = f"rm -f {VERIFIER_DIR}/reward.txt {VERIFIER_DIR}/reward.json && mkdir -p {VERIFIER_DIR}"
    bundle = f".harbor-tests-{secrets.token_hex(8)}.tar"
    if upload:
        await box.write_file(bundle, tests_tar(tests, executables))
        prepare += (
            f" && find {TESTS_DIR} -mindepth 1 -delete && tar -xf {bundle} -C {TESTS_DIR} --no-same-owner"
        )
    res = await _exec(box, prepare, 60, f"{once}.prepare" if once else None, user)
    if upload:
        await box.exec(f"rm -f {bundle}", timeout_s=60)
    if res.exit_code != 0:
        raise EnvironmentFailure(f"task {task_id}: could not copy tests/ to {TESTS_DIR}: {res.output[-300:]}")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(env.items()))
    test = f"{TESTS_DIR}/test.sh"
    run = (
        f"chmod +x {test} 2>/dev/null; {exports}"
        f"if [ -x {test} ]; then {test}; else bash {test}; fi "
        f"> {VERIFIER_DIR}/test-stdout.txt 2>&1 </dev/null"
    )
    res = await _exec(box, run, timeout_s, f"{once}.run" if once else None, user)
    if res.timed_out:
        raise EnvironmentFailure(
            f"task {task_id}: the verifier ran past its timeout ([verifier].timeout_sec = {timeout_s:g} s)"
        )
    read = (
        f"for f in reward.json reward.txt; do if [ -f {VERIFIER_DIR}/$f ]; then echo '{REWARD_MARK}'$f; "
        f"base64 -w0 {VERIFIER_DIR}/$f; echo; exit 0; fi; done; echo '{REWARD_MARK}none'; "
        f"tail -c 400 {VERIFIER_DIR}/test-stdout.txt 2>/dev/null"
    )
    out = await box.exec(read, timeout_s=60)
    return parse_reward(task_id, out.output)


async def _exec(
    box: Sandbox, cmd: str, timeout_s: float, once_key: str | None, user: str | None
) -> ExecResult:
    if user is None:  # sandboxes that predate exec users take no ``user``
        return await box.exec(cmd, timeout_s=timeout_s, once_key=once_key)
    return await box.exec(cmd, timeout_s=timeout_s, once_key=once_key, user=user)


def parse_reward(task_id: str, output: str) -> Score:
    """The reward from the reading command's output (Harbor's rule; see the module docstring)."""
    _, mark, rest = output.partition(REWARD_MARK)
    name, _, body = rest.partition("\n")
    name = name.strip()
    if not mark or name == "none":
        tail = " ".join(body.split())[-300:]
        raise EnvironmentFailure(
            f"task {task_id}: the verifier wrote no reward ({VERIFIER_DIR}/reward.txt or reward.json); "
            f"test output: {tail or '(none)'}"
        )
    try:
        text = base64.b64decode(body.strip()).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise EnvironmentFailure(f"task {task_id}: {VERIFIER_DIR}/{name} is not text") from None
    if not text:
        raise EnvironmentFailure(f"task {task_id}: reward file {VERIFIER_DIR}/{name} is empty")
    if name == "reward.txt":
        try:
            value = float(text)
        except ValueError:
            raise EnvironmentFailure(
                f"task {task_id}: {VERIFIER_DIR}/reward.txt: not a number: {text[:80]!r}"
            ) from None
        if not math.isfinite(value):
            raise EnvironmentFailure(
                f"task {task_id}: {VERIFIER_DIR}/reward.txt: non-finite reward {value!r}"
            )
        return Score(reward=value, metrics={"reward": value})
    try:
        rewards = json.loads(text)
    except ValueError:
        raise EnvironmentFailure(f"task {task_id}: {VERIFIER_DIR}/reward.json: not JSON") from None
    if not isinstance(rewards, dict) or not rewards:
        raise EnvironmentFailure(f"task {task_id}: {VERIFIER_DIR}/reward.json: not a flat dict of numbers")
    for key, value in rewards.items():
        if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            raise EnvironmentFailure(
                f"task {task_id}: {VERIFIER_DIR}/reward.json: {key!r}: {value!r} is not a finite number"
            )
    metrics = {str(k): float(v) for k, v in rewards.items()}
    reward = metrics["reward"] if "reward" in metrics else sum(metrics.values()) / len(metrics)
    return Score(reward=reward, metrics=metrics)
