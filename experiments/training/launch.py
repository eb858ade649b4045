"""A trial's training on several devices, as its own process group launched by the sweep worker.

Lightning's standalone DDP launcher starts the other local ranks by running `sys.argv` again: in a
sweep worker that would start a second worker. So a trial with more than one rank
(`ProcessGroup.ranks > 1`, from the spec's `slurm.tasks_per_trial` / `gpus_per_trial`) trains in a
child command, `python -m experiments.train fit --config <run dir>/trial_config.yaml
--mlflow_run_id <the trial's parent run> [--ckpt_path last]`, launched

- under SLURM (inside the array task's allocation, `srun` on the PATH): by `srun --nodes=N
  --ntasks=R --ntasks-per-node=R/N --cpus-per-task=C [--gpus-per-node=G] --kill-on-bad-exit=1`, one
  task per rank (Lightning's SLURMEnvironment reads the ranks; it refuses a bare `--ntasks`);
- otherwise (one node): as one process that Lightning's standalone launcher turns into R ranks by
  running that command again; several nodes outside SLURM are refused.

The worker alone talks to Optuna; training rank 0 alone logs, into the parent run the worker made
(it is left open), so a trial keeps one parent run. The child runs in its own session; the worker
forwards a stop request (its SIGUSR1 / SIGTERM) as SIGUSR1 to that process group (srun passes it to
every task), the ranks agree on the step, write `last.ckpt` once and exit 3; a worker that dies
takes its training with it (the launcher asks the kernel for SIGTERM on the worker's death, which
checkpoints and stops the ranks), so a reaped and re-run trial never races an orphan in its
directory. The child's output is appended to `<run dir>/train.log`.
`MTPC_TRIAL_TRAIN_SCRIPT` names a script run instead of `-m experiments.train` (the tests run the
CLI with test-only hooks, tests/ddp_run.py).
Leaves out: what is trained (fit.py), evaluation (trial.py: it runs in the worker afterwards).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.training.config import TrainConfig
from mtpc.atomic import write_text

#: exit codes of `python -m experiments.train` after a stop with `last.ckpt` written (train.STOP_CODES)
STOPPED_CODES = {3, 128 + signal.SIGTERM, 128 + signal.SIGINT}
SCRIPT_ENV = "MTPC_TRIAL_TRAIN_SCRIPT"
CONFIG_FILE = "trial_config.yaml"
LOG_FILE = "train.log"

# Runs `argv[2:]` after asking for SIGTERM when the worker (pid argv[1]) dies (Linux prctl; a no-op
# elsewhere). A trampoline instead of `preexec_fn`, which is unsafe beside the heartbeat thread.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)  # the worker died before the request\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True)
class ProcessGroup:
    """The devices of one trial: `ranks` processes over `nodes` nodes, `gpus_per_node` GPUs each (0: CPU)."""

    ranks: int = 1
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    """CPUs per rank under srun (null: the allocation's SLURM_CPUS_PER_TASK)"""

    @property
    def tasks_per_node(self) -> int:
        return self.ranks // self.nodes


def under_slurm(env: dict[str, str] | None = None) -> bool:
    """Inside a SLURM allocation with `srun` available (the worker then launches the ranks with srun)."""
    env = os.environ if env is None else env
    return "SLURM_JOB_ID" in env and shutil.which("srun", path=env.get("PATH")) is not None


def command(
    group: ProcessGroup,
    config: Path,
    *,
    mlflow_run_id: str | None,
    resume: bool,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The training command of one trial: srun's line under SLURM, else the plain CLI (Lightning's
    standalone launcher starts the other local ranks). ValueError for several nodes outside SLURM."""
    env = os.environ if env is None else env
    script = env.get(SCRIPT_ENV)
    train = [
        sys.executable,
        *([script] if script else ["-m", "experiments.train"]),
        "fit",
        "--config",
        str(config),
    ]
    if mlflow_run_id:
        train += ["--mlflow_run_id", mlflow_run_id]
    if resume:
        train += ["--ckpt_path", "last"]
    if not under_slurm(env):
        if group.nodes > 1:
            raise ValueError(
                f"slurm.nodes_per_trial: a trial on {group.nodes} nodes needs SLURM (srun); "
                "outside SLURM a trial's ranks run on this machine"
            )
        return train
    cpus = group.cpus_per_task or int(env.get("SLURM_CPUS_PER_TASK", "1"))
    cmd = [
        "srun",
        f"--nodes={group.nodes}",
        f"--ntasks={group.ranks}",
        f"--ntasks-per-node={group.tasks_per_node}",
        f"--cpus-per-task={cpus}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
    ]
    if group.gpus_per_node:
        cmd.append(f"--gpus-per-node={group.gpus_per_node}")
    return cmd + train


def train_process_group(
    cfg: TrainConfig,
    group: ProcessGroup,
    *,
    mlflow_run_id: str | None,
    should_stop: Callable[[], bool],
    poll_s: float = 0.5,
) -> bool:
    """Train `cfg` (a trial's config, devices and strategy set for `group`) in its own process group;
    returns True when it stopped on request with `last.ckpt` written (False: trained to the end).
    RuntimeError naming the exit code and the log's last lines when training failed."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / CONFIG_FILE
    import yaml

    write_text(config, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    resume = (run_dir / "checkpoints" / "last.ckpt").exists()
    cmd = command(group, config, mlflow_run_id=mlflow_run_id, resume=resume)
    log_path = run_dir / LOG_FILE
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        forwarded = False
        try:
            while proc.poll() is None:
                if should_stop() and not forwarded:
                    _signal_group(proc, signal.SIGUSR1)  # every rank checkpoints at the same step and exits 3
                    forwarded = True
                time.sleep(poll_s)
        except BaseException:
            _signal_group(proc, signal.SIGTERM)
            proc.wait()
            raise
    rc = proc.returncode
    if rc == 0:
        return False
    if rc in STOPPED_CODES and (run_dir / "checkpoints" / "last.ckpt").exists():
        return True
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    raise RuntimeError(
        f"training ({group.ranks} ranks: {' '.join(cmd[:1])} ...) exited with code {rc}; "
        f"log {log_path}:\n" + "\n".join(tail)
    )


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
