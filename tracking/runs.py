"""Runs in the store: describing a run (git SHA, package versions, resolved config), a trial's
parent run (create or reopen, params, metrics, tags, end), reading runs back page by page, and
closing runs that a failed attempt left RUNNING.

Every function takes the tracking URI (or a client) and explicit run ids. Leaves out: the URI rule
and experiments (tracking/store.py) and the layout of evaluation runs (tracking/evaluations.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracking.store import client

REPO = Path(__file__).resolve().parents[1]
PARENT_TAG = "mlflow.parentRunId"
#: MLflow's own tag for the commit (the UI shows it); `git_sha` is the same value under a short name
GIT_TAGS = ("mlflow.source.git.commit", "git_sha")
ERROR_TAG = "mtpc.error"
#: packages whose versions describe a run
PACKAGES = (
    "torch",
    "lightning",
    "transformers",
    "peft",
    "mlflow",
    "optuna",
    "jsonargparse",
    "safetensors",
    "numpy",
    "mtpc",
)
MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 5000


# ------------------------------------------------------------------------------ run description


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none): timings on a shared
    cloud host move with it (cache sizes), so results name it."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine(device: Any = None) -> dict[str, Any]:
    """Where this process runs, the one description every result carries: python, torch and
    transformers versions, the CPU model (`cpu_model`), its core and torch thread counts, and the GPU
    (name, CUDA version, SMs, memory) when CUDA is available or `device` is a CUDA device."""
    import os
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info.update(
        cpu=cpu_model() or platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
    )
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if cuda:
        p = torch.cuda.get_device_properties(device if device is not None else 0)
        info.update(
            gpu=p.name,
            cuda=torch.version.cuda,
            sms=p.multi_processor_count,
            memory_gib=p.total_memory / 2**30,
        )
    return info


def machine_line(info: dict[str, Any]) -> str:
    """`machine()` in one line: `<GPU or CPU <model> x<threads> threads>; torch <v>; python <v>`."""
    dev = info["gpu"] if "gpu" in info else f"CPU {info['cpu']} x{info['threads']} threads"
    return f"{dev}; torch {info['torch']}; python {info['python']}"


def git_sha(root: Path = REPO) -> str:
    """The checkout's commit, `-dirty` when tracked files changed; else `.device/GIT_SHA` (the
    device machine's copy has no .git; experiments.shipping.device_prep writes it); else "unknown"."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        if out.returncode == 0 and sha:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    f = root / ".device" / "GIT_SHA"
    return f.read_text().strip() if f.is_file() else "unknown"


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def describe_run(
    uri: str, run_id: str, config: dict[str, Any], run_dir: Path, params: dict[str, Any] | None = None
) -> None:
    """What a run was: `params` (those not logged yet), the git SHA as tags, and under the artifact
    path `run/` the resolved config (`config.yaml`), `git_sha.txt` and `package_versions.json`
    (also written to `<run_dir>/description/`)."""
    import yaml

    log_params(uri, run_id, params or {})
    sha = git_sha()
    set_tags(uri, run_id, dict.fromkeys(GIT_TAGS, sha))
    desc = Path(run_dir) / "description"
    desc.mkdir(parents=True, exist_ok=True)
    (desc / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (desc / "git_sha.txt").write_text(sha + "\n")
    (desc / "package_versions.json").write_text(json.dumps(package_versions(), indent=2) + "\n")
    client(uri).log_artifacts(run_id, str(desc), artifact_path="run")


# ------------------------------------------------------------------------------- writing runs


def start_parent_run(
    uri: str,
    experiment_id: str,
    run_name: str,
    *,
    params: dict[str, Any],
    tags: dict[str, str],
    resume_run_id: str | None = None,
) -> str:
    """Create (or reopen, when a trial resumes) the parent run of a trial; log params and tags."""
    c = client(uri)
    if resume_run_id:
        c.update_run(resume_run_id, status="RUNNING")
        run_id = resume_run_id
        set_tags(uri, run_id, tags)
    else:
        run_id = c.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    log_params(uri, run_id, params)
    return run_id


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Log the params the run does not have yet (MLflow refuses to change a logged param)."""
    from mlflow.entities import Param

    c = client(uri)
    existing = c.get_run(run_id).data.params if params else {}
    new = [Param(k, param_str(v)) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), 100):
        c.log_batch(run_id, params=new[i : i + 100])


def param_str(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list, tuple)) else str(v)
    return s[:MAX_PARAM_CHARS]


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    ms = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
    c = client(uri)
    for i in range(0, len(ms), 500):
        c.log_batch(run_id, metrics=ms[i : i + 500])


def set_tags(uri: str, run_id: str, tags: dict[str, Any]) -> None:
    c = client(uri)
    for k, v in tags.items():
        c.set_tag(run_id, k, str(v)[:MAX_TAG_CHARS])


def terminate(uri: str, run_ids: list[str], status: str) -> None:
    c = client(uri)
    for rid in run_ids:
        c.set_terminated(rid, status)


# ------------------------------------------------------------------------------- reading runs


def iter_runs(c, experiment_ids: list[str], filter_string: str = "") -> Iterator[Any]:
    """Every run of the experiments matching `filter_string`, page by page."""
    token = None
    while True:
        page = c.search_runs(experiment_ids, filter_string=filter_string, max_results=1000, page_token=token)
        yield from page
        token = page.token
        if not token:
            break


def child_runs(uri: str, experiment_id: str, parent_run_id: str, *, finished_only: bool = True) -> list:
    """The child runs of a parent (FINISHED ones only, unless `finished_only` is False)."""
    flt = f"tags.`{PARENT_TAG}` = '{parent_run_id}'"
    if finished_only:
        flt += " and attributes.status = 'FINISHED'"
    return list(iter_runs(client(uri), [experiment_id], flt))


def discard_children(uri: str, experiment_id: str, parent_run_id: str) -> int:
    """Delete (soft) the children of an interrupted attempt, so a resumed trial reports only the
    evaluations of its final attempt."""
    c = client(uri)
    runs = child_runs(uri, experiment_id, parent_run_id, finished_only=False)
    for r in runs:
        c.delete_run(r.info.run_id)
    return len(runs)


def close_if_running(
    uri: str, experiment_id: str | None, parent_run_id: str, status: str, error: str
) -> bool:
    """End a parent run (and its children) still RUNNING after its attempt ended elsewhere (a dead
    worker, a store that was down when the attempt failed): `status` and the `mtpc.error` tag.
    Returns whether anything was RUNNING."""
    c = client(uri)
    parent = c.get_run(parent_run_id)
    kids = child_runs(uri, experiment_id, parent_run_id, finished_only=False) if experiment_id else []
    open_kids = [r.info.run_id for r in kids if r.info.status == "RUNNING"]
    terminate(uri, open_kids, "KILLED")
    if parent.info.status != "RUNNING":
        return bool(open_kids)
    set_tags(uri, parent_run_id, {ERROR_TAG: error})
    terminate(uri, [parent_run_id], status)
    return True
