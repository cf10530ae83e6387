"""The committed JSON Schemas of the export records: ``rollout.json`` and ``group.json``.

Generated from ``records/models.py``; regenerate with ``python -m records.schema`` after changing a model
(and bump ``SCHEMA_VERSION``). ``python -m records.schema --check`` exits 1 when a file is stale.
"""
