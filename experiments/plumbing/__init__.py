"""The plumbing every job of the suite shares: config parsing, run directories, the timing lock, console output.

- `parsing.py`: bounded YAML, `Fail`, `parse_section`, the override rule, `--set` flags, the class allow-list
- `run_dir.py`: one run per run directory (identity, `RunLock`), resume-path checks, atomic checkpoint IO
- `timing_lock.py`: the machine-wide timing lock and the pause protocol (the CLI: `experiments/background.py`)
- `progress.py`: the training progress lines (the run's name, its real steps, the ETA)
- `quiet.py`: the library messages the command lines do not show

Imports no other part of `experiments/`.
"""
