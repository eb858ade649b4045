"""An in-process stand-in for EvaByte's remote code (module layout only; see modeling_evabyte.py)."""
