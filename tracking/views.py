"""What the MLflow UI shows first: the experiment kind, the saved runs view that compares heads, and
the link that opens it.

- Kind: `tracking.ensure_experiment` gives every experiment `mlflow.experimentKind =
  custom_model_development` (store.KIND_TAG / CLASSIC_KIND: the classic model-development kind,
  which MLflow 3's UI shows as "Machine learning").
  MLflow 3.17's UI takes the kind from its GenAI / Model-training switch instead (kept in the
  browser, default GenAI, overridden by `?workflowType=machine_learning` in the page address), so
  `runs_url` puts that in the link as well (the UI's code reads the tag where that switch is
  turned off).
- The saved view `compare heads` (experiment tag `mlflow.sharedViewState.mtpc-compare`, the
  format of the UI's "Views" menu): the columns a user compares — the params circuit, rank, window,
  lora_depth and, per evaluation label (`greedy`, `sample`, `sample-T0.7`, ...), the parent-run
  metrics `<label>/mu_acc`, `<label>/mu_lat`, `<label>/throughput`, `<label>/speedup_vs_stp`
  (tracking.evaluations.log_trial_summary), in that order, wide enough for their names.
Leaves out: writing runs (tracking/runs.py, tracking/evaluations.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from tracking.schema import GRID_PARAMS
from tracking.store import client

#: the page-address switch of MLflow 3.17's UI between its GenAI and Model-training layouts
WORKFLOW_QUERY = "workflowType=machine_learning"
#: saved runs views are experiment tags `<prefix><id>` holding {"name", "createdAt", "state"}
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_ID = "mtpc-compare"
VIEW_NAME = "compare heads"
#: widths of the view's columns: `mtpc-demo/cp-r8-n16-k1` and `greedy/speedup_vs_stp` show whole
RUN_NAME_COLUMN = "attributes.`Run Name`"
RUN_NAME_PX = 240
PARAM_PX = 100
METRIC_PX = 150
#: the parent-run metrics the view shows per evaluation label, in column order
COMPARED_METRICS: tuple[str, ...] = ("mu_acc", "mu_lat", "throughput", "speedup_vs_stp")


def column(kind: str, name: str) -> str:
    """A column of the UI's runs table: `params.`circuit``, `metrics.`greedy/mu_acc``."""
    return f"{kind}.`{name}`"


def view_columns(labels: Sequence[str]) -> list[str]:
    """The view's columns: the grid params, then COMPARED_METRICS for each evaluation label."""
    return [column("params", p) for p in GRID_PARAMS] + [
        column("metrics", f"{label}/{m}") for label in labels for m in COMPARED_METRICS
    ]


def save_runs_view(uri: str, experiment_id: str, labels: Sequence[str]) -> str:
    """Store (or replace) the saved view `compare heads` on the experiment; returns its id. The view
    keeps the UI's default order (newest first): sorting by a metric would un-nest the evaluation
    runs from their trial (a click on a column header sorts)."""
    cols = view_columns(labels)
    widths = {RUN_NAME_COLUMN: RUN_NAME_PX} | {
        c: PARAM_PX if c.startswith("params.") else METRIC_PX for c in cols
    }
    state = {"selectedColumns": cols, "columnOrder": [RUN_NAME_COLUMN, *cols], "columnWidths": widths}
    now = int(time.time() * 1000)
    envelope = {"name": VIEW_NAME, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
    client(uri).set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + VIEW_ID, json.dumps(envelope))
    return VIEW_ID


def runs_url(server: str, experiment_id: str, view: str | None = VIEW_ID) -> str:
    """The address of the experiment's runs table (with the saved view, if any) on an MLflow server
    at `server` (e.g. http://127.0.0.1:5000)."""
    query = WORKFLOW_QUERY + (f"&viewStateShareKey={view}" if view else "")
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"
