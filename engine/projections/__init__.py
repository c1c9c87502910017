"""Projections: pure folds of events into state (no Redis, no files, no clock)."""
