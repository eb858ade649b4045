#!/bin/bash
# One Optuna sweep as a SLURM array job: every task runs the (idempotent, locked) init step, then
# a worker that takes waiting trials until none are left. All tasks join one study.
#
#   sbatch slurm/sweep.sh sweeps/arch_grid.yaml [sweeps.run options, e.g. --set train.max_steps=50]
#   sbatch --array=0-15 --time=12:00:00 --gpus-per-task=1 slurm/sweep.sh sweeps/arch_grid.yaml
#   # trials of 2 GPUs each (spec: slurm: {gpus_per_trial: 2}): every array task holds one trial's ranks
#   sbatch --array=0-7 --nodes=1 --ntasks=2 --ntasks-per-node=2 --gpus-per-node=2 --cpus-per-task=8 slurm/sweep.sh SPEC
#
# A trial of several ranks (the spec's slurm.tasks_per_trial / gpus_per_trial / nodes_per_trial)
# trains in an `srun` step the worker starts inside this task's allocation (experiments/training/launch.py);
# a task whose allocation is smaller than one trial stops with exit code 2 naming the key.
# The #SBATCH lines are defaults; command-line options override them. `python -m sweeps.run SPEC
# --submit` validates the spec, initialises the study and submits with the spec's resources.
# Storage: the spec's Optuna journal file on a shared filesystem (default) or an RDB URL;
# MTPC_OPTUNA_STORAGE and MLFLOW_TRACKING_URI in the submitting environment override the spec.
# Python: $MTPC_PYTHON, else <submit dir>/.venv/bin/python, else python3.
#
# Pre-emption: SLURM sends SIGUSR1 to this script 120 s before the time limit (--signal=B:USR1@120);
# it is forwarded to the worker, which checkpoints the running trial and exits 75 leaving the trial
# RUNNING; this script then requeues the task, and the requeued task (same job id) resumes that
# trial from its checkpoint. scancel / requeue send SIGTERM: the worker checkpoints and stops; the
# trial is resumed by the requeued task or, if the job is gone, failed and re-enqueued by a reaper.
#SBATCH --job-name=mtpc-sweep
#SBATCH --array=0-3
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --export=ALL
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
set -uo pipefail

SPEC=${1:?usage: sbatch slurm/sweep.sh SPEC.yaml [sweeps.run options]}
shift
cd "${SLURM_SUBMIT_DIR:-.}" || exit 1
if [ -n "${MTPC_PYTHON:-}" ]; then
    PY=$MTPC_PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
# the worker is one process: Lightning must not treat it as a multi-process job (experiments/training/fit.py chooses
# LightningEnvironment outside an srun step of several tasks); threads per task (and per rank of a
# multi-rank trial's srun step) follow the allocation.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export PYTHONUNBUFFERED=1

echo "sweep.sh: job ${SLURM_JOB_ID:-?} (array ${SLURM_ARRAY_JOB_ID:-?}_${SLURM_ARRAY_TASK_ID:-?}, restart ${SLURM_RESTART_COUNT:-0}) on $(hostname) spec $SPEC"
# --task = the idempotent init (file-locked: the first task creates the study, the others find it)
# followed by a worker, in one process; exit code 2 = bad spec or unreachable store (message above).
"$PY" -m sweeps.run "$SPEC" --task "$@" &
WORKER=$!
GOT=""
trap 'GOT=USR1; kill -USR1 "$WORKER" 2>/dev/null' USR1
trap 'GOT=TERM; kill -TERM "$WORKER" 2>/dev/null' TERM
# `wait` returns early (status > 128) when a trapped signal arrives: wait until the worker is gone.
while :; do
    wait "$WORKER"
    RC=$?
    kill -0 "$WORKER" 2>/dev/null && continue
    if [ "$RC" -gt 128 ] && [ -n "$GOT" ]; then
        # interrupted by the trap just as the worker exited: fetch its real status (127: already had it)
        wait "$WORKER" 2>/dev/null
        RC2=$?
        [ "$RC2" != 127 ] && RC=$RC2
    fi
    break
done
echo "sweep.sh: worker exited with $RC${GOT:+ after SIG$GOT}"
# the task's own id: in an array the bare SLURM_JOB_ID of one task can equal the whole array's id
TASK_ID=${SLURM_JOB_ID:-}
[ -n "${SLURM_ARRAY_JOB_ID:-}" ] && TASK_ID=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
if [ "$RC" = 75 ] && [ "$GOT" = USR1 ] && [ -n "$TASK_ID" ]; then
    echo "sweep.sh: requeueing $TASK_ID to resume the checkpointed trial"
    scontrol requeue "$TASK_ID"
    exit 0
fi
exit "$RC"
