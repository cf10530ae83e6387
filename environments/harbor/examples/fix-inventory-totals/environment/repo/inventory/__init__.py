"""A small inventory package."""
