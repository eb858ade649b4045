"""DDP on this CPU: Lightning's standalone DDP over gloo with 2 processes (`tests/ddp_run.py`, the CLI
with test-only hooks), against one process with the whole batch.

Tolerance (float reassociation): a step's gradient is the same sum of the same per-row terms, but
each rank sums its own rows (chunked) and gloo adds the two ranks' sums, where one process adds all
rows in one order: float32 rounding differs at ~1e-7 relative. The logged loss of a step is a
function of the parameters before it, so the trajectory agrees to rtol 1e-5 (measured: 5e-7 over
12 steps). Adam divides each gradient element by its running RMS, so an element whose gradient is
near zero can move by a rounding-sized fraction of lr per step: final parameters agree to atol
5e-4 = 5 % of one step at lr 1e-2 (measured: 3.3e-5 after 12 steps). Dropping or doubling one
rank's gradient moves the second step's loss by far more than that (test_mutated_rank_is_caught).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from experiments.training.datamodule import EpochSampler, PackedRows, ResumableLoader, target_table
from experiments.training.fit import train_head

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "ddp_run.py"
BASE = [
    "--config",
    str(ROOT / "experiments/configs/debug.yaml"),
    "--model.lora_depth",
    "1",
    "--run.checkpoint_every_n_steps",
    "2",
]
TWO = ["--data.batch_size", "2", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
ONE = ["--data.batch_size", "4"]
LOSS_RTOL, PARAM_ATOL = 1e-5, 5e-4


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("MTPC_TEST_", "SLURM_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
        )
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _fit(run_dir: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    record = run_dir.parent / f"{run_dir.name}.jsonl"
    return subprocess.run(
        [sys.executable, str(HELPER), "fit", *BASE, *args, "--run.dir", str(run_dir), *env.pop("extra", [])],
        env=_env(MTPC_TEST_RECORD=str(record), **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _losses(run_dir: Path) -> list[float]:
    path = run_dir.parent / f"{run_dir.name}.jsonl"
    return [json.loads(line)["train_loss"] for line in path.read_text().splitlines()]


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    head = run_dir / "head"
    return {
        **load_file(head / "head.safetensors"),
        **{f"lora.{k}": v for k, v in load_file(head / "lora.safetensors").items()},
    }


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with batch 4 and two with 2 each: the same debug run (two stages, LoRA from epoch 1)."""
    root = tmp_path_factory.mktemp("ddp")
    _ok(_fit(root / "one", ONE))
    _ok(_fit(root / "two", TWO))
    return root


def _same_trajectory(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= LOSS_RTOL * abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_two_processes_equal_one_with_the_whole_batch(runs):
    one, two = runs / "one", runs / "two"
    assert len(_losses(one)) == 12 and _same_trajectory(_losses(one), _losses(two))
    a, b = _params(one), _params(two)
    assert a.keys() == b.keys() and any(k.startswith("lora.") for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=PARAM_ATOL), (k, float((a[k] - b[k]).abs().max()))
        assert not torch.equal(a[k], torch.zeros_like(a[k]))
    m1, m2 = (json.loads((r / "metrics.json").read_text()) for r in (one, two))
    for key in ("val_loss", "val_nll_1", "val_stp_nll", "val_window_kl"):  # sums and counts over ranks
        assert abs(m1[key] - m2[key]) <= 1e-5 * abs(m1[key]), key
    assert m1["global_step"] == m2["global_step"] == 12
    config = json.loads((two / "run.json").read_text())["config"]
    assert config["data"]["global_batch_size"] == 4  # 2 devices x 2 rows: stated in the resolved config


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["drop", "double"])
def test_mutated_rank_is_caught(runs, tmp_path, mutation):
    """Rank 1's gradient dropped or doubled: the same comparison fails (on the first 3 steps)."""
    run = tmp_path / "mutant"
    _ok(_fit(run, TWO, MTPC_TEST_MUTATE=mutation, extra=["--trainer.max_steps", "3"]))
    got, want = _losses(run), _losses(runs / "one")[:3]
    assert len(got) == 3 and got[0] == pytest.approx(want[0], rel=LOSS_RTOL)  # step 1: before any update
    assert not _same_trajectory(got, want)
    assert abs(got[1] - want[1]) > 10 * LOSS_RTOL * abs(
        want[1]
    )  # measured: 9e-4 relative (double), more (drop)


@pytest.mark.slow
def test_kill9_both_ranks_then_resume_equals_uninterrupted(runs, tmp_path):
    run = tmp_path / "killed"
    step_file = tmp_path / "step"
    cmd = [sys.executable, str(HELPER), "fit", *BASE, *TWO, "--run.dir", str(run)]
    env = _env(
        MTPC_TEST_STEP_SLEEP="1",
        MTPC_TEST_STEP_FILE=str(step_file),
        MTPC_TEST_RECORD=str(tmp_path / "k.jsonl"),
    )
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )  # its own process group: rank 0 and the rank 1 it starts
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if step_file.exists() and step_file.read_text().strip() and int(step_file.read_text()) >= 5:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # both ranks at once, mid-run (after the step-4 checkpoint)
    proc.wait()
    proc.stderr.close()
    assert not (run / "metrics.json").exists() and (run / "checkpoints" / "last.ckpt").is_file()
    _ok(_fit(run, TWO, extra=["--ckpt_path", "last"]))
    a, b = _params(runs / "two"), _params(run)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k] - b[k]).abs().max()))


# --- in one process: the loader's sharding and the global-batch normalisation -------------------


def _rows(n: int = 11, seq: int = 16) -> PackedRows:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (n, seq), generator=g)
    mask = torch.rand(n, seq, generator=g) > 0.5
    mask[3] = False  # a row without any scored target
    docs = torch.zeros(n, seq, dtype=torch.long)
    docs[:, seq // 2 :] = 1
    return PackedRows(type("P", (), {"input_ids": ids, "score_mask": mask, "doc_ids": docs})())


def test_loader_shards_every_row_once_and_matches_one_process():
    rows, world, b, accumulate = _rows(), 2, 2, 2
    table = target_table(rows, 4)
    loaders = [
        ResumableLoader(
            rows,
            b,
            seed=3,
            progress=lambda: 0,
            rank=r,
            world_size=world,
            accumulate=accumulate,
            has_target=table,
        )
        for r in range(world)
    ]
    single = ResumableLoader(
        rows, b * world, seed=3, progress=lambda: 0, accumulate=accumulate, has_target=table
    )
    order = EpochSampler(len(rows), 3).order(0)
    steps = [list(loader) for loader in loaders]
    assert (
        len(steps[0]) == len(steps[1]) == len(single) == 3
    )  # ceil(11 / 4): same number of steps on every rank
    seen = []
    for k, whole in enumerate(single):
        parts = [steps[r][k] for r in range(world)]
        for p in parts:
            assert torch.equal(p[3], whole[3])  # the optimizer step's counts, known to every rank
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])  # the same rows, in the same order
        for r in range(world):
            mine, padded = loaders[r].step_rows(order, k)
            assert not padded  # the last step's 3 rows: 2 on rank 0, 1 on rank 1
            seen += mine
    assert sorted(seen) == list(range(len(rows)))  # every row once per epoch across ranks
    # the last step (rows 8..10) is one accumulation group of its own: counts over those rows only
    assert torch.equal(steps[0][2][3], table[order[8:]].sum(0))
    assert torch.equal(steps[0][0][3], table[order[:8]].sum(0))  # steps 0 and 1 form one group


def test_loader_pads_a_rank_left_without_rows():
    rows = _rows(n=5)
    loader = ResumableLoader(rows, 2, seed=0, progress=lambda: 0, rank=1, world_size=2)
    *_, last = list(loader)  # step 1 holds row 4 only: rank 1 reads one row, unscored
    assert last[0].shape[0] == 1 and not last[1].any()


def test_loader_resume_skips_whole_steps_and_refuses_another_step_size():
    rows = _rows()
    a = ResumableLoader(rows, 2, seed=1, progress=lambda: 1, rank=1, world_size=2)
    state = a.state_dict()
    b = ResumableLoader(rows, 2, seed=1, progress=lambda: 0, rank=1, world_size=2)
    b.load_state_dict(state)
    assert [t[0].tolist() for t in b] == [t[0].tolist() for t in list(a)[1:]]
    c = ResumableLoader(rows, 2, seed=1, progress=lambda: 0)
    with pytest.raises(ValueError, match="rows per step"):
        c.load_state_dict(state)


def test_window_loss_parts_with_the_global_counts_add_up_to_the_whole_batch():
    from mtpc.heads import HeadConfig, MtpcHead
    from mtpc.losses import window_loss

    rows = _rows(n=6)
    head = MtpcHead(HeadConfig(kind="cp", window=4, rank=3, vocab=256, hidden=8)).double()
    e = torch.randn(6, 16, 8, dtype=torch.float64)
    ids, mask, docs = rows.input_ids, rows.score_mask, rows.doc_ids
    whole = window_loss(head, e, ids, mask, docs, chunk_size=5)
    counts = target_table(rows, 4).sum(0)
    parts = [
        window_loss(head, e[s], ids[s], mask[s], docs[s], chunk_size=5, examples=counts)
        for s in (slice(0, 4), slice(4, 6))
    ]  # rank 0 holds the row without targets
    assert torch.allclose(sum(p.loss for p in parts), whole.loss, rtol=1e-12)
    assert torch.allclose(sum(p.per_position_nll for p in parts), whole.per_position_nll, rtol=1e-12)
    own = window_loss(head, e, ids, mask, docs, chunk_size=5, examples=whole.examples)
    assert torch.equal(own.loss, whole.loss)  # one device: the batch's own counts, the same result


def test_accumulated_micro_batches_equal_the_whole_batch(tmp_path):
    """batch 2 x 2 accumulated == batch 4 (one process): the counts span the micro-batches."""
    common = {"trainer.max_steps": 4, "run.checkpoint_every_n_steps": 0}
    a = train_head("debug", {**common, "data.batch_size": 4}, run_dir=tmp_path / "a")
    b = train_head(
        "debug", {**common, "data.batch_size": 2, "data.global_batch_size": 4}, run_dir=tmp_path / "b"
    )
    assert b.config["trainer"]["accumulate_grad_batches"] == 2
    pa, pb = load_file(a.head_dir / "head.safetensors"), load_file(b.head_dir / "head.safetensors")
    for k in pa:
        assert torch.allclose(pa[k], pb[k], rtol=0, atol=PARAM_ATOL), k
