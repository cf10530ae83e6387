"""One turn of a rollout, with no Temporal in it: what the activities of a turn run, and reproduce and the
benchmarks call.

- ``budget``: how many tokens a model call may sample, and when a limit truncates the rollout (the only
  place either is computed: the workflow, the model call, the engine client, reproduce and the benchmarks
  call it).
- ``model``: a model turn: the prompt rendered and stored once, a model call on the stored context, its
  segment stored (idempotent on (rollout id, turn)), and an inline environment's step run inside it.
- ``step``: the environment's step on a stored turn: parse, act (recorded before it runs), observe (the
  observation's tokens stored), score.
- ``sequence``: the turn sequence of a rollout (budget, model turn, verdicts, env step, until an outcome),
  run by the rollout workflow and by the batch activity alike, each with its own steps.
- ``engine``: what a turn needs of an engine (``engines.client.EngineClient`` is one).
- ``clock``: the store seconds a turn spends (transfer time).

Invariant: nothing here imports ``temporalio``, ``activities``, ``workflows`` or ``engines``
(tests/unit/test_architecture.py): an activity passes in what only Temporal knows (the attempt number, the
seconds its task queued) and maps the ``RolloutError`` a turn raises to its ``ApplicationError``.
"""
