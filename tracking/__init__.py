"""MLflow for the whole suite, in one place below experiments/, sweeps/ and analysis/ (which all
import it; it imports none of them, and `mtpc/` stays free of MLflow).

- `tracking.store`: the tracking-URI rule (explicit argument > $MLFLOW_TRACKING_URI > configured
  value > sqlite:///<cwd>/mlflow.db), reachability and write probes, `ensure_experiment`.
- `tracking.runs`: run description (git SHA, package versions, resolved config), parent runs,
  reading runs back, closing runs a failed attempt left RUNNING.
- `tracking.evaluations`: the one writer of evaluation child runs and the reader of them; the
  per-label summary a trial's parent run carries.
- `tracking.views`: what the MLflow UI opens on: the saved runs view `compare heads`, the link.
- `tracking.schema`: the experiment schema (sweep axes, grid key, evaluation params, metrics and
  artifact names; names only, not re-exported here but STORED_METRICS).

Everything is re-exported here: `import tracking; tracking.ensure_experiment(uri, name)`.
"""

import os as _os
import sys as _sys

# No import from the current directory (docs/reliability.md, "No code without consent"): `python -m`
# puts it first on sys.path, where a planted `torch.py` or `yaml.py` would shadow the real module.
# Dropped before anything is imported, unless it is the checkout this package runs from.
_here = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
_cwd = _os.path.realpath(_os.getcwd())
if _cwd != _here:
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _cwd]
del _os, _sys, _here, _cwd

from tracking.evaluations import (  # noqa: E402 - after the import-path guard
    NAME_PARAMS,
    SUMMARY_METRICS,
    SUMMARY_TAG,
    evaluation_label,
    evaluation_run_name,
    evaluation_runs,
    is_evaluation_run,
    log_evaluation,
    log_trial_summary,
    summary_metrics,
)
from tracking.runs import (  # noqa: E402 - after the import-path guard
    ERROR_TAG,
    GIT_TAGS,
    PARENT_TAG,
    child_runs,
    close_if_running,
    describe_run,
    discard_children,
    git_sha,
    iter_runs,
    log_metrics,
    log_params,
    package_versions,
    set_tags,
    start_parent_run,
    terminate,
)
from tracking.schema import STORED_METRICS  # noqa: E402
from tracking.store import (  # noqa: E402 - after the import-path guard
    DEFAULT_DB,
    TRACKING_ENV,
    TrackingError,
    TrackingURI,
    check_tracking,
    client,
    ensure_experiment,
    experiment_id,
    open_for_reading,
    probe_write,
    quick_failures,
    resolve_uri,
    short,
    sqlite_path,
)
from tracking.views import VIEW_ID, runs_url, save_runs_view, view_columns  # noqa: E402

__all__ = [
    "DEFAULT_DB", "ERROR_TAG", "GIT_TAGS", "NAME_PARAMS", "PARENT_TAG", "STORED_METRICS", "SUMMARY_METRICS",
    "SUMMARY_TAG", "TRACKING_ENV", "VIEW_ID", "TrackingError", "TrackingURI", "check_tracking", "child_runs", "client",
    "close_if_running", "describe_run", "discard_children", "ensure_experiment", "evaluation_label",
    "evaluation_run_name", "evaluation_runs", "experiment_id", "git_sha", "is_evaluation_run", "iter_runs",
    "log_evaluation", "log_metrics", "log_params", "log_trial_summary", "open_for_reading", "package_versions",
    "probe_write", "quick_failures", "resolve_uri", "runs_url", "save_runs_view", "set_tags", "short",
    "sqlite_path", "start_parent_run", "summary_metrics", "terminate", "view_columns",
]  # fmt: skip
