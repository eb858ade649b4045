"""Tests of bench/ (dry runs of the benchmark scripts, so they do not rot between device sessions)."""
