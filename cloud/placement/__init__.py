"""Placement: which models run where (pure functions, no I/O)."""
