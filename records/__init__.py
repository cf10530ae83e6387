"""The export contract: rollout and group records as trainers read them (JSONL), and their lineage."""
