"""The plain data that crosses process boundaries: workflow and activity inputs and results, run and
rollout state, outcomes, engine readings.

Invariant: nothing here imports anything heavier than pydantic and the config models, and nothing here
carries token arrays (these objects travel through Temporal history, where only keys, counts and small
scalars belong). Every top-level package may import it; it imports none of workflows, activities, envs,
store, engines or workers.
"""
