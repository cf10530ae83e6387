"""Every ``workflow.patched`` id of the workflows, the release that introduced it, and how long it lives.

Policy (docs/upgrades.md, "How long a patch lives"):

- The supported upgrade is from the previous release to this one: workflows started by release
  `SUPPORTED_FROM` must continue on this code, and the replay suite holds their histories
  (``tests/histories/<SUPPORTED_FROM>/``). Runs started by anything older must finish on their own release.
- A patch introduced in release R (the first release whose histories carry its marker) keeps its old branch
  (``if workflow.patched(ID): new else: old``) while ``SUPPORTED_FROM < R``: some supported history was
  recorded without it.
- Once ``SUPPORTED_FROM == R`` no supported history can take the old branch: the patch is retired with
  ``workflow.deprecate_patch(ID)`` and the old branch deleted (histories of R carry the marker, which
  ``deprecate_patch`` accepts, as it accepts its absence).
- Once ``SUPPORTED_FROM > R`` the ``deprecate_patch`` call goes too (every supported history was recorded
  by code that deprecated it, whose marker is ignored when nothing asks for it).

``tests/unit/workflows/test_patches.py`` reads the workflows' source and fails when a call does not match
this table (an unregistered id, ``patched`` where the policy says ``deprecate_patch``, or the reverse), so
bumping `SUPPORTED_FROM` at a release tells exactly which branches to delete.
"""

from __future__ import annotations

from dataclasses import dataclass

REVISION = 3
"""The command revision of the workflows this code starts (``RolloutInput.revision``,
``GroupInput.revision``). A change of commands that only workflows started after the upgrade may take rides
on it instead of a patch: the parent sets it in the child's input, inputs written before lack it (0), so a
replayed history takes its old branch without any marker. Cheaper than a patch (``patched`` records a
marker and upserts ``TemporalChangeVersion``: two events and a visibility write per workflow), and
retired like one (docs/upgrades.md). Revision 1: rollouts and groups no longer call
``deprecate_patch(OPS)`` (its marker is in 0.2.0 histories only). Revision 2: a batched group
(``group.batch_rollouts``) writes its record and signals its run in one local activity instead of a signal
command (a workflow task and five events fewer per group). Revision 3: every group writes its record and
reports to its run in that local activity, by the run's ``group_report`` update, which the run refuses while
it drains for continue-as-new (no report lands in the task that carries the continue-as-new)."""

SUPPORTED_FROM = "0.2.0"
"""The oldest release whose in-flight workflows this code continues (the previous release)."""

CURRENT = "0.3.0"
"""The release this code becomes: patches added now are introduced in it."""


@dataclass(frozen=True)
class Patch:
    id: str
    introduced: str
    """The first release whose workflows record this patch's marker (take its new branch)."""
    what: str


OPS = Patch(
    "ops-search-attributes",
    "0.2.0",
    "Rollouts index the operating search attributes (progress time, replica, sandbox host, attempt) and a "
    "queued member its progress time.",
)
FINAL_DECISION = Patch(
    "final-dispatch-decision",
    CURRENT,
    "An adaptive run writes its last decision and steps the controller once more after its last group, "
    "and logs it, however the last group ended (0.2.0 wrote the last decision only when a decision saw "
    "the last group gone).",
)
PROBE_ADMISSION = Patch(
    "probe-admission",
    CURRENT,
    "A run uses the admission preset its config names (default probe); 0.2.0 configs knew only prime-rl.",
)
PROBE_RAMP = Patch(
    "probe-ramp",
    CURRENT,
    "The probe preset ramps (rule P0) and holds near a storm (P4).",
)
RUN_CANCEL = Patch(
    "run-cancel",
    CURRENT,
    "A cancelled run cancels its groups and waits for them (0.2.0 runs just ended, abandoning them).",
)
FOOTPRINT = Patch(
    "probe-footprint",
    CURRENT,
    "The probe preset predicts rollouts' final footprints from the ended ones (rule P5).",
)
CONCURRENT_START = Patch(
    "concurrent-group-start",
    CURRENT,
    "Groups admitted at one decision start in one workflow task (0.2.0 started them one by one).",
)
TASK_TIMEOUT = Patch(
    "task-timeout",
    CURRENT,
    "A task's own wall-clock limit (RolloutState.task_deadline) runs as a timer of its own.",
)
NOTICE_CLOSED_GROUPS = Patch(
    "notice-closed-groups",
    CURRENT,
    "The run notices groups that closed without reporting (terminated from the web UI or CLI).",
)
INFRA_RETRIES = Patch(
    "infra-retries",
    CURRENT,
    "A slot whose member failed for infrastructure runs again (GroupInput.infra_retries).",
)
ENV_STOP = Patch(
    "environment-stop",
    CURRENT,
    "A streak of environment failures stops the run (run.max_consecutive_environment_failures).",
)
HARNESS = Patch(
    "harness-rollouts",
    CURRENT,
    "A harness environment's rollout runs its harness with its calls served (workflows/harness_steps.py); "
    "a path rollouts of other environments never take.",
)
RUN_ACTIVITIES = Patch(
    "run-regular-activities",
    CURRENT,
    "The run workflow calls its activities (fleet poll, task ids, closed-group checks, terminated groups) "
    "as regular activities: a local activity's result may be delivered to a run in another activation on "
    "replay than live, beside the group_done signals, and the run then replayed into a nondeterminism "
    "error (temporalio 1.32-1.35; sdk-python issue 1881).",
)

QUIET_SEGMENT_END = Patch(
    "quiet-segment-end",
    CURRENT,
    "Before it continues as new, and before its end, a run waits until every group of its segment that has "
    "reported has also closed: the close (ChildWorkflowExecutionCompleted) follows the group_done signal by "
    "one task of the group, and landing while the run's closing workflow task was in flight it had the "
    "server reject that task (UNHANDLED_COMMAND) and the worker replay the segment.",
)
READING_AGE = Patch(
    "reading-age-at-poll",
    CURRENT,
    "An adaptive run ages its engine readings at the poll that read them, not at its decision: a decision "
    "that waited for a workflow-task slot longer than metrics_max_age_s found every engine stale and "
    "admitted nothing.",
)
QUEUE_RACE = Patch(
    "queued-groups-reported-in-poll",
    CURRENT,
    "An adaptive run with max_queued_groups counts the groups that reported while its fleet poll was in "
    "flight as waiting for the trainer: the poll may have counted the unconsumed groups before their "
    "records, and the run no longer counts them in flight, so one more group was admitted past the limit.",
)

PATCHES: tuple[Patch, ...] = (
    OPS,
    FINAL_DECISION,
    PROBE_ADMISSION,
    PROBE_RAMP,
    RUN_CANCEL,
    FOOTPRINT,
    CONCURRENT_START,
    TASK_TIMEOUT,
    NOTICE_CLOSED_GROUPS,
    INFRA_RETRIES,
    ENV_STOP,
    HARNESS,
    RUN_ACTIVITIES,
    QUIET_SEGMENT_END,
    READING_AGE,
    QUEUE_RACE,
)


def run_local() -> bool | None:
    """What the run workflow passes as ``call(..., local=...)``: False (a regular activity) under
    RUN_ACTIVITIES, None (the activity's declared kind: local) on the old branch. Workflow code only."""
    from temporalio import workflow

    return False if workflow.patched(RUN_ACTIVITIES.id) else None


def release(version: str) -> tuple[int, ...]:
    """A release's version as a comparable tuple (``"0.2.0"`` -> ``(0, 2, 0)``)."""
    return tuple(int(part) for part in version.split("."))


def stage(patch: Patch, supported_from: str = SUPPORTED_FROM) -> str:
    """What the policy says the workflows call for ``patch``: ``patched`` (old branch kept),
    ``deprecate_patch`` (old branch gone, marker accepted) or ``removed`` (no call)."""
    introduced, oldest = release(patch.introduced), release(supported_from)
    if oldest < introduced:
        return "patched"
    return "deprecate_patch" if oldest == introduced else "removed"
