"""A separate verifier, as Harbor runs one (``harbor/trial/trial.py`` ``_run_separate_verifier``,
``harbor/models/task/verifier_mode.py``, ``harbor/trial/artifact_handler.py``).

A task with ``[verifier].environment_mode = "separate"`` (or a ``[verifier.environment]``) is verified,
after the agent's last turn, in a fresh sandbox of its own (``TurnContext.sandboxes``, named ``verifier``):

- Its image, by Harbor's precedence: ``[verifier.environment].docker_image``, else ``tests/Dockerfile``
  (``tests/`` the build context), both holding ``/tests`` themselves (Harbor's bundled tests: nothing is
  copied in); else the task's own image (``environment/``), with ``tests/`` copied to ``/tests`` as in a
  shared verifier. Built on the rollout's host like the task's image, offline, once per content hash.
  Its resources: ``[verifier.environment]``, else the task's ``[environment]``.
- The agent's artifacts handed over: each ``artifacts`` entry (an absolute path, or one relative to the
  agent's working directory), and Harbor's ``/logs/artifacts`` always, packed in the agent's sandbox
  (without its ``exclude`` patterns) and unpacked at the same path in the verifier's, a folder replacing
  what the verifier's image has there (Harbor empties it first). A declared path the agent never made is
  skipped, as Harbor skips it (the tests then judge its absence); one that cannot be packed or placed is
  `EnvironmentFailure`. Nothing else of the agent's container is visible to the verifier.
- ``tests/test.sh`` run as ``[verifier].user`` (the verifier sandbox's user; unset: the sandbox's default
  non-root user), the reward read as a shared verifier's (`harbor_env.verifier`).

Invariants: the verifier sandbox is keyed by the rollout (``<rollout id>#verifier``) and its setup, the
unpacking and the tests are keyed execs of scope ``score-N``: a retried score reattaches to the same
container and gets the first run's results, never running the tests twice. It is removed with the rollout's
own sandbox (the rollout's destroy step, right after scoring; the reaper if that never runs), so the
agent's sandbox outlives the copy. A Docker failure is infrastructure (`SandboxError`), never a reward.
"""

from __future__ import annotations

import hashlib
import shlex

from durable_rollouts.environments.base import Sandbox, SandboxPlan, Score, TurnContext
from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes.base import ImageBuild, SandboxSpec
from harbor_env import verifier
from harbor_env.config import (
    ARTIFACTS_DIR,
    ArtifactConfig,
    EnvironmentConfig,
    artifact_entries,
    healthcheck_bound_s,
    user_name,
    verifier_environment,
)
from harbor_env.tasks import DEFAULT_WORKDIR, SEED_VERSION, HarborTask, dockerfile_workdir

NAME = "verifier"
"""The verifier's sandbox among the rollout's (``Sandboxes.open``)."""
KEEP_OUT = (".dr-once", ".dr-laid-out")
"""Names never unpacked from an artifact nor cleared by one (an agent's /tmp handed over): the verifier
sandbox's keyed-exec records (``sandboxes`` keeps them in /tmp/.dr-once) and its setup marker, which an
agent's copies would otherwise forge or erase."""
PACK = ".harbor-artifact"
"""Prefix of the artifact archives in either sandbox's working directory (left out of what is packed)."""


class Definition:
    """Where the separate verifier comes from (Harbor's ``VerifierEnvironmentDefinition``): its
    environment, image build, working directory, and whether its image holds ``/tests`` (``bundled``)."""

    def __init__(self, t: HarborTask) -> None:
        from harbor_env import image_build, image_tag, seed_layer

        env = verifier_environment(t.cfg)
        assert env is not None, f"task {t.id}: the verifier shares the agent's container"
        self.env: EnvironmentConfig = env
        own = t.cfg.verifier.environment
        tests = t.tree("tests")
        if own is not None and own.docker_image:
            self.bundled, self.workdir = True, env.workdir or DEFAULT_WORKDIR
            build = ImageBuild(tag="-", context={"Dockerfile": _b64(f"FROM {own.docker_image}\n".encode())})
        elif "Dockerfile" in tests:
            dockerfile = tests["Dockerfile"].decode("utf-8", errors="replace")
            self.bundled = True
            self.workdir = env.workdir or dockerfile_workdir(dockerfile) or DEFAULT_WORKDIR
            executables = [p.removeprefix("tests/") for p in t.executables if p.startswith("tests/")]
            context = {p: _b64(b) for p, b in tests.items()}
            build = ImageBuild(tag="-", context=context, executables=executables)
        else:
            self.bundled, self.workdir = False, env.workdir or t.workdir
            if self.workdir == t.workdir:  # the agent's very image
                self.build = image_build(t, image_tag(t))
                return
            self.build = _tagged(image_build(t, "-", self.workdir), t, env)
            return
        dockerfile = _unb64(build.context["Dockerfile"]).decode("utf-8", errors="replace")
        context = {**build.context, "Dockerfile": _b64((dockerfile + seed_layer(self.workdir)).encode())}
        self.build = _tagged(build.model_copy(update={"context": context}), t, env)


def _tagged(build: ImageBuild, t: HarborTask, env: EnvironmentConfig) -> ImageBuild:
    """``build`` tagged by its content hash, with the verifier's build timeout."""
    digest = hashlib.sha256()
    for part in (SEED_VERSION, repr(sorted(build.context.items())), repr(sorted(build.executables))):
        digest.update(part.encode() + b"\0")
    return build.model_copy(
        update={
            "tag": f"dr-harbor-verifier:{digest.hexdigest()[:32]}",
            "timeout_s": env.build_timeout_sec,
            "what": f"task {t.id} (its separate verifier)",
        }
    )


def plan(t: HarborTask, base: SandboxSpec) -> tuple[SandboxPlan, Definition]:
    """The verifier sandbox's plan, from the rollout's own sandbox's spec ``base`` (the run's defaults)."""
    from harbor_env import HEADROOM_MB, SEED_DIR, healthcheck_script

    d = Definition(t)
    env = d.env
    mounts = {"/logs": 32} if d.bundled else {"/logs": 32, "/tests": 32}
    memory = env.memory_mb or base.memory_mb
    room = memory - base.tmp_size_mb - sum(mounts.values()) - HEADROOM_MB
    workdir_mb = min(env.storage_mb or base.workdir_size_mb, room)
    if workdir_mb < 16:
        raise EnvironmentFailure(f"task {t.id}: verifier memory_mb {memory} leaves no room for its workdir")
    ver = user_name(t.cfg.verifier.user)
    default_user = SandboxSpec.model_fields["user"].default
    user = ver or (default_user if base.user_source else base.user)
    where = f"task {t.id} ({t.source}/task.toml)"
    spec = base.model_copy(
        update={
            "image": d.build.tag, "workdir": d.workdir, "memory_mb": memory,
            "cpus": float(env.cpus) if env.cpus is not None else base.cpus, "workdir_size_mb": workdir_mb,
            "mounts": mounts, "env": {**base.env, **env.env}, "gateway": False, "exec_users": {},
            "user": user, "user_source": f"{where} [verifier].user = {ver!r}" if ver else "",
            "allow_root": ver is not None,
        }
    )  # fmt: skip
    SandboxSpec.model_validate(spec.model_dump())  # the copy skipped validation
    setup = [
        f"if [ -d {SEED_DIR} ]; then cp -r {SEED_DIR}/. ./; fi",
        "mkdir -p /logs/verifier " + ARTIFACTS_DIR + " && chmod 777 " + " ".join([*mounts, "/logs/verifier"]),
    ]
    setup_timeout = 600.0
    if env.healthcheck is not None:
        setup.append(healthcheck_script(env.healthcheck))
        setup_timeout = max(setup_timeout, healthcheck_bound_s(env.healthcheck) + 30)
    return SandboxPlan(spec=spec, image_build=d.build, setup=setup, setup_timeout_s=setup_timeout), d


async def verify(ctx: TurnContext, t: HarborTask, agent: Sandbox) -> Score:
    """Verify the rollout of ``t`` in a sandbox of its own (see the module docstring)."""
    if ctx.sandboxes is None:
        raise EnvironmentFailure(f"task {t.id}: a separate verifier needs a worker that makes sandboxes")
    p, d = plan(t, await ctx.sandboxes.base_spec())
    archives = [await _pack(agent, t, i, a) for i, a in enumerate(artifact_entries(t.cfg))]
    box = await ctx.sandboxes.open(NAME, p)
    scope = f"score-{ctx.turn}"
    for i, (path, kind, data) in enumerate(archives):
        if kind != "missing":
            await _unpack(box, t, scope, i, path, kind, data)
    ver = t.cfg.verifier
    tests = t.tree("tests")
    executables = {p.removeprefix("tests/") for p in t.executables if p.startswith("tests/")}
    return await verifier.verify(
        box, t.id, tests, executables, ver.timeout_sec, ver.env, once=scope, upload=not d.bundled
    )


def source_path(t: HarborTask, a: ArtifactConfig) -> str:
    """An artifact's absolute path in the agent's container (a relative one is in its working directory)."""
    path = a.source if a.source.startswith("/") else f"{t.workdir.rstrip('/')}/{a.source}"
    return "/" + "/".join(part for part in path.split("/") if part and part != ".")


async def _pack(agent: Sandbox, t: HarborTask, i: int, a: ArtifactConfig) -> tuple[str, str, bytes]:
    """(path, "dir" | "file" | "missing", tar archive) of one artifact, packed in the agent's sandbox: a
    folder's entries (not the folder itself, whose owner and mode stay the verifier's), or the file."""
    path = source_path(t, a)
    archive = f"{t.workdir.rstrip('/')}/{PACK}-{i}.tar"
    tar = f"tar -cf {archive} --exclude='{PACK}-*.tar'" + "".join(
        f" --exclude={shlex.quote(x)}" for x in a.exclude
    )
    cmd = (
        f"rm -f {archive}; p={shlex.quote(path)}; "
        'if [ -d "$p" ]; then echo kind=dir; '
        f"""out=$(cd "$p" && find . -mindepth 1 -maxdepth 1 -printf '%P\\0' | {tar} --null -T - 2>&1); """
        'elif [ -e "$p" ]; then echo kind=file; '
        f'out=$({tar} -C "$(dirname "$p")" -- "$(basename "$p")" 2>&1); '
        "else echo kind=missing; exit 0; fi; "
        '[ $? = 0 ] || { echo "$out" | tail -c 300; exit 1; }'
    )
    res = await agent.exec(cmd, timeout_s=600)
    kind = "missing" if "kind=missing" in res.output else ("dir" if "kind=dir" in res.output else "file")
    if kind == "missing":
        return path, kind, b""
    if res.exit_code != 0 or res.timed_out:
        raise EnvironmentFailure(
            f"task {t.id}: artifact {a.source!r}: could not pack {path} in the agent's sandbox: "
            f"{res.output[-300:].strip()}"
        )
    rel = archive.removeprefix(t.workdir.rstrip("/") + "/")
    try:
        data = await agent.read_file(rel, max_bytes=256 << 20)
    finally:
        await agent.exec(f"rm -f {archive}", timeout_s=60)
    return path, kind, data


async def _unpack(box: Sandbox, t: HarborTask, scope: str, i: int, path: str, kind: str, data: bytes) -> None:
    """Place one packed artifact at its path in the verifier's sandbox (a folder's entries replacing what
    the folder held, but for the sandbox's own records: `KEEP_OUT`)."""
    archive = f"{PACK}-{i}.tar"
    await box.write_file(archive, data)
    q = shlex.quote(path)
    if kind == "dir":
        keep = "".join(f" ! -name {name}" for name in KEEP_OUT)
        place = f"mkdir -p {q} && find {q} -mindepth 1 -maxdepth 1{keep} -exec rm -rf {{}} + && cd {q}"
    else:
        place = f'mkdir -p "$(dirname {q})" && cd "$(dirname {q})"'
    excludes = "".join(f" --exclude={name}" for name in KEEP_OUT)
    cmd = (
        f"exec 3< {archive} && rm -f {archive} && {place} && "
        f"tar -xf - --no-same-owner --no-overwrite-dir -m{excludes} <&3"
    )
    res = await box.exec(cmd, timeout_s=600, once_key=f"{scope}.artifact-{i}")
    await box.exec(f"rm -f {archive}", timeout_s=60)  # a retry's copy (its keyed exec did not run again)
    if res.exit_code != 0 or res.timed_out:
        raise EnvironmentFailure(
            f"task {t.id}: artifact {path}: could not place it in the verifier's sandbox: "
            f"{res.output[-300:].strip()}"
        )


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)
