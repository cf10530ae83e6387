"""Length-aware groups (Seer-style): a group's members start in waves, and the held-back siblings are
scheduled by the lengths their group's first members reported, longest predicted first.

Invariant: `LengthAwareScheduler` is a deterministic state machine over (config, state, calls). It owns no
clock, I/O or randomness and imports only the standard library and pydantic, so it runs inside a Temporal
workflow and replays identically; its whole memory is `LengthAwareState`, a pydantic model a workflow can
carry through history. Every member of an admitted group starts at most once, never before its group is
admitted, and ends at most once; ``plan`` never starts more than it is allowed.

Only the benchmarks use it (bench/admission_fleet.py, bench/admission_family.py), so it lives beside them;
RunWorkflow does not (docs/measurements/length-aware.md: off by default, it loses there).

Seer (Moonshot AI, 2025) sends one speculative request per group first, takes its length as the group's
estimate and schedules the remaining requests approximately longest-first; it relies on the lengths of
siblings (one prompt) being correlated, as they are in RL: a hard task is long in every sibling. Here:

- Admission: ``plan`` takes new groups from the caller's ``offered`` queue, in order, each with its first
  wave: members ``0 .. probe - 1`` start at once (a group is admitted only when its whole first wave fits
  in what is left of ``allowed``). The other members are held.
- Release: a group's held siblings become startable once one of its members finished (its length is the
  first prediction), or once the whole first wave ended without a length (failed or cancelled: released
  with no prediction, so no member is lost). With ``release = "progress"`` a running member's progress
  report (tokens generated so far, after a turn; Seer's divided rollout learns from chunks in the same way)
  releases the group too, its tokens so far counting as a (lower-bound) length.
- Prediction: the max (default) or the mean of the group's known lengths (finished members', and with
  ``release = "progress"`` running members' tokens so far). Max, as Seer does: a group is done when its
  longest member is, so the longest sibling seen is the best single guess of how long the group still
  holds the fleet; under heavy tails the mean of two finishers hides the one long sibling that matters.
- Each ``plan(allowed, offered)`` starts, up to ``allowed`` members in all:
  1. released siblings, longest predicted first (a released group with no prediction ranks first: nothing
     says it is short, and it has waited a whole wave already); ties by group admission order, then member
     index. Siblings go before new groups' probes so every started group finishes;
  2. new groups' first waves, from ``offered`` in order, while a whole wave fits and, with ``max_held``,
     while the members held behind groups not yet released stay within it (each new group adds
     ``size - probe``): the bound keeps the waves from piling up a backlog of siblings that then wait
     behind each other;
  3. work-conserving fallback: only when no offered group is left to admit, or ``max_held`` stopped
     admission, and room is left: held siblings of groups still waiting for their first wave, in admission
     order, with no prediction (idle capacity would gain nothing by waiting).
- Replica hint (``long_factor`` set and ``replica_load`` given): a start predicted at least
  ``long_factor`` x the mean finished member length goes to the least-loaded replica (ties by name), whose
  load then grows by its prediction; other starts carry no hint (the caller's own placement).

With ``enabled`` off, ``plan`` starts members in group order (the members left of partly started groups
first, then new groups), no waves: the order a plain dispatcher admits in.

Ending: the caller reports every started member's end exactly once (`end`, outcome finished, failed or
cancelled); a group whose every member ended is complete and leaves the state. A cancelled member ends
there: restarting it (the dispatcher's redispatch) is the caller's business and outside this policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Outcome = Literal["finished", "failed", "cancelled"]
Wave = Literal["probe", "sibling", "fallback", "plain"]


class LengthAwareConfig(BaseModel):
    """The dispatcher option; off by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Off: members start in group order, no waves (`LengthAwareScheduler.plan`)."""
    probe: int = Field(default=1, ge=1)
    """First-wave members of a newly admitted group (Seer's one speculative request per group: 1)."""
    predictor: Literal["max", "mean"] = "max"
    """How a group's known lengths make its prediction (module docstring: why max)."""
    release: Literal["finish", "progress"] = "finish"
    """What releases the held siblings: a first-wave member's end, or already its first progress report."""
    long_factor: float | None = Field(default=None, gt=0.0)
    """Replica hint for starts predicted at least this many times the mean finished length; None: none."""
    max_held: int | None = Field(default=None, ge=0)
    """Members held behind groups not yet released, at most: a new group is admitted only while its held
    members fit (or nothing is held), else the room left goes to the fallback. None: no bound."""


class GroupOffer(BaseModel):
    """A group the caller could admit now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_id: str = Field(min_length=1)
    size: int = Field(ge=1)


class GroupBook(BaseModel):
    """One admitted group: who started, who ended how, the lengths seen."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=1)
    seq: int = Field(ge=0)
    """Admission order."""
    wave: int = Field(ge=1)
    """First-wave members: ``0 .. wave - 1``."""
    started: list[int] = Field(default_factory=list)
    ended: dict[int, Outcome] = Field(default_factory=dict)
    lengths: dict[int, int] = Field(default_factory=dict)
    """Finished members' generated tokens."""
    progress: dict[int, int] = Field(default_factory=dict)
    """Running members' tokens so far (only with ``release = "progress"``)."""
    released: bool = False


class LengthAwareState(BaseModel):
    """Everything the scheduler remembers: the groups not yet complete and two running sums."""

    model_config = ConfigDict(extra="forbid")

    groups: dict[str, GroupBook] = Field(default_factory=dict)
    admitted: int = 0
    """Groups admitted so far (the next one's ``seq``)."""
    finished_members: int = 0
    finished_tokens: int = 0
    """Sum of finished members' lengths (their mean scales ``long_factor``)."""


class Start(BaseModel):
    """One member to start now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_id: str
    member: int
    wave: Wave
    predicted_tokens: int | None = None
    replica: str | None = None
    """Where to run it (predicted long: the least-loaded replica); None: the caller's choice."""


class Plan(BaseModel):
    """What one ``plan`` call decided."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    starts: list[Start] = Field(default_factory=list)
    admitted: list[str] = Field(default_factory=list)
    """Groups admitted by this call (a prefix of ``offered``)."""


class LengthAwareScheduler:
    """Which members of which groups start now; see the module docstring for the rules."""

    def __init__(self, config: LengthAwareConfig, state: LengthAwareState | None = None) -> None:
        self.config = config
        self.state = state.model_copy(deep=True) if state is not None else LengthAwareState()

    def predicted(self, group_id: str) -> int | None:
        """The group's predicted member length (tokens), or None with nothing known yet."""
        book = self.state.groups[group_id]
        known = list(book.lengths.values())
        if self.config.release == "progress":
            known += [t for m, t in book.progress.items() if m not in book.ended]
        if not known:
            return None
        return max(known) if self.config.predictor == "max" else round(sum(known) / len(known))

    def held(self) -> int:
        """Members of admitted groups not started yet."""
        return sum(b.size - len(b.started) for b in self.state.groups.values())

    def plan(
        self,
        allowed: int,
        offered: Sequence[GroupOffer],
        replica_load: Mapping[str, float] | None = None,
    ) -> Plan:
        """Start at most ``allowed`` members: released siblings, new groups' first waves, fallback.

        Raises:
            ValueError: ``offered`` names a group twice, or one already admitted (and nothing changed).
        """
        st, cfg = self.state, self.config
        left = max(0, allowed)
        starts: list[Start] = []
        admitted: list[str] = []

        def start(gid: str, member: int, wave: Wave, predicted: int | None = None) -> None:
            st.groups[gid].started.append(member)
            starts.append(Start(group_id=gid, member=member, wave=wave, predicted_tokens=predicted))

        ids = [o.group_id for o in offered]
        if len(set(ids)) < len(ids) or set(ids) & set(st.groups):
            raise ValueError(f"a group was offered twice: {ids}")

        def admit(offer: GroupOffer, wave: int) -> None:
            st.groups[offer.group_id] = GroupBook(size=offer.size, seq=st.admitted, wave=wave)
            st.admitted += 1
            admitted.append(offer.group_id)

        by_seq = sorted(st.groups.items(), key=lambda kv: kv[1].seq)
        if not cfg.enabled:
            for gid, book in by_seq:
                for m in _unstarted(book)[:left]:
                    start(gid, m, "plain")
                    left -= 1
            for offer in offered:
                if left == 0:
                    break
                admit(offer, offer.size)
                for m in range(min(left, offer.size)):
                    start(offer.group_id, m, "plain")
                left -= min(left, offer.size)
            return Plan(starts=starts, admitted=admitted)

        ready = [
            (gid, m, self.predicted(gid)) for gid, book in by_seq if book.released for m in _unstarted(book)
        ]
        seq = {gid: book.seq for gid, book in st.groups.items()}
        ready.sort(key=lambda x: (x[2] is not None, -(x[2] or 0), seq[x[0]], x[1]))
        for gid, m, pred in ready[:left]:
            start(gid, m, "sibling", pred)
        left -= min(left, len(ready))
        taken, bounded = 0, False
        holding = sum(b.size - len(b.started) for b in st.groups.values() if not b.released)
        for offer in offered:
            wave = min(cfg.probe, offer.size)
            if wave > left:
                break
            if cfg.max_held is not None and holding and holding + offer.size - wave > cfg.max_held:
                bounded = True
                break
            holding += offer.size - wave
            admit(offer, wave)
            for m in range(wave):
                start(offer.group_id, m, "probe")
            st.groups[offer.group_id].released = wave == offer.size
            left -= wave
            taken += 1
        if left and (taken == len(offered) or bounded):
            for gid, book in sorted(st.groups.items(), key=lambda kv: kv[1].seq):
                if not book.released:
                    for m in _unstarted(book)[:left]:
                        start(gid, m, "fallback")
                        left -= 1
        return Plan(starts=self._hint(starts, replica_load), admitted=admitted)

    def progress(self, group_id: str, member: int, tokens: int) -> None:
        """A running member's tokens so far (after a turn); used only with ``release = "progress"``."""
        if self.config.release != "progress":
            return
        book = self._running(group_id, member)
        book.progress[member] = max(0, tokens)
        book.released = True

    def end(self, group_id: str, member: int, outcome: Outcome, tokens: int = 0) -> bool:
        """A started member ended (``tokens``: its generated length, used when it finished). Returns whether
        its group is now complete (every member ended; the group leaves the state).

        Raises:
            ValueError: the member was never started, or already ended.
        """
        st = self.state
        book = self._running(group_id, member)
        book.ended[member] = outcome
        book.progress.pop(member, None)
        if outcome == "finished":
            book.lengths[member] = max(0, tokens)
            st.finished_members += 1
            st.finished_tokens += max(0, tokens)
        if book.lengths or all(m in book.ended for m in range(book.wave)):
            book.released = True
        if len(book.ended) == book.size:
            del st.groups[group_id]
            return True
        return False

    def _running(self, group_id: str, member: int) -> GroupBook:
        book = self.state.groups.get(group_id)
        if book is None or member not in book.started:
            raise ValueError(f"member {member} of group {group_id!r} was not started")
        if member in book.ended:
            raise ValueError(f"member {member} of group {group_id!r} already ended")
        return book

    def _hint(self, starts: list[Start], replica_load: Mapping[str, float] | None) -> list[Start]:
        """Predicted-long starts to the least-loaded replica (``long_factor``)."""
        cfg, st = self.config, self.state
        if cfg.long_factor is None or not replica_load or st.finished_members == 0:
            return starts
        threshold = cfg.long_factor * st.finished_tokens / st.finished_members
        load = dict(replica_load)
        out = []
        for s in starts:
            if s.predicted_tokens is not None and s.predicted_tokens >= threshold:
                replica = min(sorted(load), key=load.__getitem__)
                load[replica] += s.predicted_tokens
                s = s.model_copy(update={"replica": replica})
            out.append(s)
        return out


def _unstarted(book: GroupBook) -> list[int]:
    started = set(book.started)
    return [m for m in range(book.size) if m not in started]
