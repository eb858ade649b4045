"""Session fixtures of the sweep tests: the real one-node SLURM cluster (slurm/local_cluster.sh,
started once per session on 127.0.0.1, stopped by PID; skipped with the reason when its Debian
packages cannot be installed) and one MLflow sqlite store for every cluster test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sweep_helpers import REPO, fresh_tracking_uri

SCRIPT = REPO / "slurm" / "local_cluster.sh"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if sys.platform != "linux" or shutil.which("bash") is None:
        pytest.skip("SLURM cluster tests need Linux and bash")
    d = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(["bash", str(SCRIPT), "start", str(d)], capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        reason = f"SLURM packages not installable here: {r.stderr.strip()[-500:]}"
        print(reason)
        pytest.skip(reason)
    assert r.returncode == 0, f"local cluster did not start:\n{r.stdout}\n{r.stderr}"
    env = dict(os.environ)
    for line in r.stdout.splitlines():
        if line.startswith("export "):
            k, v = line[len("export ") :].split("=", 1)
            env[k] = v
    env["MTPC_PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("MTPC_OPTUNA_STORAGE", None)
    pids = {n: int((d / f"{n}.pid").read_text()) for n in ("slurmctld", "slurmd", "munged")}
    yield {"dir": d, "env": env}
    subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, text=True, timeout=120)
    for name, pid in pids.items():
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        ), f"{name} still running"


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """One MLflow sqlite store for every cluster test (its creation is the slow part)."""
    return fresh_tracking_uri(tmp_path_factory.mktemp("slurm_mlflow"))
