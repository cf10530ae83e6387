"""The export contract: rollout and group records as trainers read them (JSONL), their typed models
(``records.record``), the committed JSON Schemas generated from them (``records/schema/``) and lineage."""
