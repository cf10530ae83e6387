"""Custom search attributes: how a person finds a rollout in the Temporal web UI.

Invariant: the names and types here are the ones the stack registers on the server and the workflows upsert.
Example filters: ``RolloutPhase = "generate"``, ``RolloutRun = "run-1" AND RolloutOutcome = "failed"``.
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

RUN = SearchAttributeKey.for_keyword("RolloutRun")
GROUP = SearchAttributeKey.for_keyword("RolloutGroup")
TASK = SearchAttributeKey.for_keyword("RolloutTask")
ENV = SearchAttributeKey.for_keyword("RolloutEnv")
PHASE = SearchAttributeKey.for_keyword("RolloutPhase")
TURN = SearchAttributeKey.for_int("RolloutTurn")
POLICY_VERSION = SearchAttributeKey.for_keyword("RolloutPolicyVersion")
OUTCOME = SearchAttributeKey.for_keyword("RolloutOutcome")

ALL = (RUN, GROUP, TASK, ENV, PHASE, TURN, POLICY_VERSION, OUTCOME)

# Name -> type as `temporal server start-dev --search-attribute Name=Type` expects it.
DEFINITIONS: dict[str, str] = {
    key.name: ("Int" if key.indexed_value_type.name == "INT" else "Keyword") for key in ALL
}
