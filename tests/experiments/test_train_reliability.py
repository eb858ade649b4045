"""Training under faults and misuse, on the CPU debug config: a run directory belongs to one run,
resume paths are checked before work (local files only, weights only, `last` must exist), bad
trainer values are one line with no directory left behind, SIGTERM / SIGINT checkpoint once and
exit non-zero, and a full disk during a checkpoint leaves the previous checkpoint loadable."""

from __future__ import annotations

import functools
import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import experiments.train as train_mod
from experiments.train import main
from experiments.training.config import CONFIG_DIR
from experiments.training.fit import train_head
from tests.faults import fill, full_disk, small_tmpfs

DEBUG = str(CONFIG_DIR / "debug.yaml")
SHORT = {"trainer.max_steps": 3, "run.checkpoint_every_n_steps": 1}


class SignalAt(Callback):
    """Sends this process `signum` after optimizer step `step` (SLURM's scancel sends SIGTERM)."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class Losses(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def test_another_run_in_the_same_directory_is_refused(tmp_path):
    train_head("debug", SHORT, run_dir=tmp_path)
    other = {**SHORT, "model.lr": 0.003}
    with pytest.raises(
        ValueError, match=rf"{tmp_path} holds another run .*model\.lr 0\.01 -> 0\.003.*another --run\.dir"
    ):
        train_head("debug", other, run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"holds another run"):  # nor may it resume the first run's last.ckpt
        train_head("debug", other, run_dir=tmp_path, ckpt_path="last")
    with pytest.raises(
        ValueError, match=r"already holds checkpoints of this run; resume with --ckpt_path last"
    ):
        train_head("debug", SHORT, run_dir=tmp_path)
    # the same run continues, with more steps (the stop length is not part of a run's identity)
    res = train_head("debug", {**SHORT, "trainer.max_steps": 5}, run_dir=tmp_path, ckpt_path="last")
    assert res.metrics["global_step"] == 5


def test_a_checkpoint_file_of_another_run_is_refused(tmp_path):
    train_head("debug", SHORT, run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"last\.ckpt: a checkpoint of another run"):
        train_head(
            "debug",
            {**SHORT, "model.rank": 2},
            run_dir=tmp_path / "b",
            ckpt_path=tmp_path / "a" / "checkpoints" / "last.ckpt",
        )


@pytest.mark.parametrize(
    "ckpt, message",
    [
        ("last", r"--ckpt_path last: nothing to resume, .*last\.ckpt does not exist"),
        ("{tmp}/nope.ckpt", r"--ckpt_path .*nope\.ckpt: no such checkpoint file"),
        ("http://127.0.0.1:8765/evil.ckpt", r"only local checkpoint files are accepted"),
    ],
)
def test_resume_paths_are_checked_before_anything_loads(tmp_path, capsys, ckpt, message):
    import re

    run = tmp_path / "run"
    code = main(["fit", "--config", DEBUG, "--run.dir", str(run), "--ckpt_path", ckpt.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not run.exists()


def test_a_pickled_payload_in_a_checkpoint_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(evil, "wb") as f:
        torch.save({"state_dict": {}, "x": Payload()}, f)
    with pytest.raises(ValueError, match=r"evil\.ckpt: refused, not a plain-tensor checkpoint"):
        train_head("debug", SHORT, run_dir=tmp_path / "run", ckpt_path=evil)
    assert not marker.exists()


def test_a_bad_trainer_value_is_one_line_and_leaves_no_directory(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--config", DEBUG, "--run.dir", str(run), "--trainer.max_epochs", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "max_epochs" in err and len(err.splitlines()) == 1, err
    assert not run.exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_sigint_checkpoint_once_and_exit_non_zero(tmp_path, monkeypatch, capsys, signum, code):
    run = tmp_path / "run"
    saves = []

    class CountSaves(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            saves.append(trainer.global_step)

    real = train_mod.train_head
    # SIGTERM twice (SLURM may repeat it): still one checkpoint; a second SIGINT would interrupt at once
    signals = [SignalAt(2, signum)] * (2 if signum == signal.SIGTERM else 1)
    monkeypatch.setattr(train_mod, "train_head", functools.partial(real, callbacks=[*signals, CountSaves()]))
    argv = ["fit", "--config", DEBUG, "--run.dir", str(run), "--run.checkpoint_every_n_steps", "0"]
    assert main(argv) == code
    out = capsys.readouterr().out
    assert f"stopped by {signal.Signals(signum).name}" in out and "--ckpt_path last" in out
    step = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert step in (2, 3) and saves == [step]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last.ckpt"
    ]  # no last-v1.ckpt beside it
    assert not (run / "head" / "head.safetensors").exists()
    monkeypatch.setattr(train_mod, "train_head", real)
    assert main([*argv, "--ckpt_path", "last"]) == 0
    assert (run / "head" / "head.safetensors").exists()


class FullDiskAt(Callback):
    def __init__(self, step, start):
        self.step, self.start = step, start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.start()


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    over = {"run.checkpoint_every_n_steps": 1, "trainer.max_steps": 6}
    with pytest.raises(OSError, match=rf"{run / 'checkpoints'}.*\.ckpt: no space left"):
        train_head(
            "debug",
            over,
            run_dir=run,
            callbacks=[FullDiskAt(3, lambda: full_disk(monkeypatch, run, after=4096))],
        )
    monkeypatch.undo()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp" in p.name]
    res = train_head("debug", over, run_dir=run, ckpt_path="last")
    assert res.metrics["global_step"] == 6


def test_on_a_real_full_tmpfs_the_previous_checkpoint_stays_loadable():
    with small_tmpfs("64m") as d:  # room for several debug checkpoints until the test fills it
        run = d / "run"
        over = {"run.checkpoint_every_n_steps": 1, "trainer.max_steps": 6}
        with pytest.raises(OSError, match="no space left"):
            train_head("debug", over, run_dir=run, callbacks=[FullDiskAt(3, lambda: fill(d, leave=4096))])
        assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_config_errors_name_the_file_or_flag_that_holds_the_value(tmp_path, capsys):
    second = tmp_path / "second.yaml"
    second.write_text("model:\n  circuit: cp\n  bogus_key: 1\n")
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--config", str(second)])
    assert f"{second}: unknown key model.bogus_key" in err, err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  circuit: [cp\n  rank: 2\n")
    err = _one_line_error(capsys, ["fit", "--config", str(broken)])
    assert f"{broken}:3: not valid YAML" in err and "unicode string" not in err, err
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--model.rank", "0"])
    assert err.startswith("error: --model.rank (command line): model.rank: 0 out of range"), err
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--trainer.max_epochs=-3"])
    assert err.startswith("error: --trainer.max_epochs (command line): trainer.max_epochs:"), err
    rank0 = tmp_path / "rank0.yaml"
    rank0.write_text("model:\n  rank: 0\n")
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--config", str(rank0)])
    assert err.startswith(f"error: {rank0}: model.rank: 0 out of range"), err


def test_a_backbone_with_a_pickled_payload_is_one_line_and_not_run(tmp_path):
    from safetensors.torch import load_file

    from mtpc.backbones import load_backbone
    from mtpc.tokenizer import ByteTokenizer
    from tests.backbone_helpers import tiny_llama

    folder = tmp_path / "bb"
    tiny_llama(vocab=320, hidden=16, layers=2, heads=2, kv_heads=1, dtype=torch.float32).save_pretrained(
        folder
    )
    ByteTokenizer().save_pretrained(folder)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({**state, "x": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"pickled weights in .* hold objects other than tensors; refused"
    ) as err:
        load_backbone(str(folder))
    assert "\n" not in str(err.value) and not marker.exists()


class CrashAt(Callback):
    """Crashes before the batch after optimizer step `step` (that step's metrics are logged by then)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("injected crash")


def test_a_resumed_run_logs_each_metric_step_once(tmp_path, monkeypatch):
    """The resumed run's metric history has the steps of an uninterrupted run's, no step twice."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    over = {"run.checkpoint_every_n_steps": 2, "run.tracking": True, "trainer.max_steps": 8}

    def history(run_id):
        keys = set(client.get_run(run_id).data.metrics)
        return {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in keys}

    ref = history(train_head("debug", over, run_dir=tmp_path / "ref").mlflow_run_id)
    with pytest.raises(
        RuntimeError, match="injected crash"
    ):  # after step 5 is logged; the checkpoint holds step 4
        train_head("debug", over, run_dir=tmp_path / "run", callbacks=[CrashAt(5)])
    got = history(train_head("debug", over, run_dir=tmp_path / "run", ckpt_path="last").mlflow_run_id)
    assert got == ref
