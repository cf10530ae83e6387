"""Admission: the pure policy the run workflow applies when it starts groups, each round.

- ``controller``: the adaptive in-flight cap (`AdmissionController`, a state machine fed with engine
  readings: how many rollouts may run, which to cancel);
- ``prime_rl``: rules 3-8, the ``prime-rl`` preset the controller applies when its config names it;
- ``backlog``: rule O, the orchestration's own backlog (vetoes growth that only lengthens rollouts);
- ``footprint``: rule P5, the rollouts' predicted KV footprints that stop the controller's blind growth;
- ``room``: the arithmetic of a round (the controller's view of the groups in flight, what the sandbox pool
  and the trainer queue leave of its admit, the cancels per group);
- ``replicas``: which engine replica a new group goes to (bounded-load affinity);
- ``breaker``: the circuit breaker (infrastructure failures pause admission; environment failures stop the
  run).

Invariant: deterministic functions and state machines of their arguments, with no clock, I/O, randomness
or Temporal in them (time arrives with each call), so the workflows call them and replay identically and
unit tests drive them directly. It imports only ``config`` and ``contracts``.
"""
