"""Evaluating heads with speculative decoding, one job per module; the CLI is `experiments/evaluate.py`.

- `config.py`: `EvalConfig`, one evaluation's settings (the CLI's flags, a sweep spec's `eval`) and their bounds
- `prompts.py`: the evaluation's prompts, drawn into disjoint seeded sets, each knowing its file:line
- `decoding.py`: `evaluate_heads` (STP, the heads and an ff reference on the same prompts), summaries, MLflow runs
- `speedup.py`: `measure_speedup`, plain and speculative decoding interleaved in one process
- `evabyte_mtp.py`: EvaByte's own multi-byte decoding as a greedy baseline

Imports `experiments.plumbing` only: nothing of training.
"""
