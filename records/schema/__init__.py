"""The committed JSON Schemas of the export records: ``rollout.json`` and ``group.json``.

Generated from ``records/record.py``; regenerate with ``python -m durable_rollouts.records.schema`` after
changing a model
(and bump ``SCHEMA_VERSION``). ``python -m durable_rollouts.records.schema --check`` exits 1 when a file is
stale.
"""
