"""Training refusals and late stops on the CPU debug config: one live run per run directory (a lock),
a directory with checkpoints or a head but no run.json, bad values refused in one line naming the key
(or the file that holds it) before anything loads and with no directory left, data that is not
UTF-8 named by file:line (or skipped and counted), and a stop signal after the last optimizer step
(the run finishes its export and says so)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from lightning.pytorch.callbacks import Callback

import experiments.train as train_mod
from experiments.train import main
from experiments.training.config import CONFIG_DIR
from experiments.training.fit import train_head

DEBUG = str(CONFIG_DIR / "debug.yaml")
SHORT = {"trainer.max_steps": 3, "run.checkpoint_every_n_steps": 1}


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


class StartBeside(Callback):
    """At optimizer step 2, runs `fit` twice more on the same run directory (a fresh start, a resume)."""

    def __init__(self, argv):
        self.argv, self.codes = argv, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and not self.codes:
            self.codes = [main(self.argv), main([*self.argv, "--ckpt_path", "last"])]


def test_a_second_start_or_resume_beside_a_live_run_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    beside = StartBeside(["fit", "--config", DEBUG, "--run.dir", str(run), "--trainer.max_steps", "3"])
    res = train_head("debug", SHORT, run_dir=run, callbacks=[beside])
    assert beside.codes == [2, 2]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    for line in err:
        assert line.startswith(f"error: {run} is in use by a live run (pid {os.getpid()} holds"), line
    assert res.metrics["global_step"] == 3 and (run / "head" / "head.safetensors").is_file()
    assert not (run / ".lock").exists()  # released when the run ended
    res = train_head("debug", {**SHORT, "trainer.max_steps": 4}, run_dir=run, ckpt_path="last")  # free again
    assert res.metrics["global_step"] == 4


def test_the_lock_names_its_holder_and_is_free_once_the_holder_is_killed(tmp_path):
    import subprocess
    import sys

    from experiments.plumbing.run_dir import RunLock

    code = (
        "import sys, time; from experiments.plumbing.run_dir import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"{tmp_path} is in use by a live run \(pid {holder.pid} holds"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock
        holder.wait()
    lock = RunLock(tmp_path).acquire()
    assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    lock.release()
    assert not (tmp_path / ".lock").exists() and tmp_path.is_dir()


def test_checkpoints_and_a_head_without_run_json_are_refused(tmp_path, capsys):
    run = tmp_path / "run"
    train_head("debug", SHORT, run_dir=run)
    (run / "run.json").unlink()
    head = (run / "head" / "head.safetensors").read_bytes()
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--run.dir", str(run), "--model.lr", "0.003"])
    assert f"{run} holds checkpoints (" in err and "a head export (head/) but no run.json" in err, err
    assert "use another --run.dir" in err, err
    with pytest.raises(ValueError, match="but no run.json"):  # the same config, or a resume: the same answer
        train_head("debug", SHORT, run_dir=run, ckpt_path="last")
    assert (run / "head" / "head.safetensors").read_bytes() == head and not (run / "run.json").exists()


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--run.cpu_threads", "-2"], "run.cpu_threads"),
        (["--data.seq_len", str(10**12)], "data.seq_len"),
        (["--seed_everything", str(2**70)], "seed_everything"),
        (["--data.seed", str(2**70)], "data.seed"),
        (["--model.backbone_kwargs", '{"bogus": 1}'], "model.backbone_kwargs.bogus"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key_before_anything_loads(
    tmp_path, capsys, monkeypatch, flags, key
):
    monkeypatch.setattr("experiments.training.module.MtpcTrainModule.__init__", None)  # nothing may be built
    run = tmp_path / "run"
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--run.dir", str(run), *flags])
    assert err.startswith(f"error: {flags[0]} (command line): {key}:"), err
    assert not run.exists()


def test_an_export_dir_that_is_a_file_is_refused_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("experiments.training.module.MtpcTrainModule.__init__", None)
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for export in (taken, taken / "head"):
        err = _one_line_error(
            capsys,
            ["fit", "--config", DEBUG, "--run.dir", str(tmp_path / "run"), "--run.export_dir", str(export)],
        )
        assert "run.export_dir:" in err and "an existing file; expected a folder" in err, err
    assert not (tmp_path / "run").exists()


def test_backbone_kwargs_the_loader_refuses_leave_no_run_behind(tmp_path, monkeypatch):
    """A key the config's check lets through but the loader refuses: one line, no run.json, no directory."""
    monkeypatch.setattr("experiments.training.config.backbone_kwarg_names", lambda bb: {"extra_window"})
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"model\.backbone_kwargs: .*extra_window") as err:
        train_head("debug", {"model.backbone_kwargs": {"extra_window": 3}}, run_dir=run)
    assert "\n" not in str(err.value) and not run.exists()


def test_a_wrong_type_in_a_second_config_names_that_file(tmp_path, capsys):
    extra = tmp_path / "extra.yaml"
    extra.write_text('model:\n  rank: "abc"\n')
    err = _one_line_error(capsys, ["fit", "--config", DEBUG, "--config", str(extra)])
    assert err.startswith(f"error: {extra}: model.rank:"), err


def test_training_data_that_is_not_utf8_names_file_and_line_or_is_skipped_and_counted(tmp_path, capsys):
    from experiments.training.datamodule import debug_conversations

    lines = [json.dumps(c).encode() for c in debug_conversations(30)]
    lines.insert(4, b'{"id": "x", "messages": [{"role": "user", "content": "caf\xe9"}]}')  # line 5: latin-1
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(b"\n".join(lines) + b"\n")
    run = tmp_path / "run"
    cli = [
        "fit",
        "--config",
        DEBUG,
        "--data.source",
        str(chats),
        "--run.dir",
        str(run),
        "--trainer.max_steps",
        "2",
    ]
    err = _one_line_error(capsys, cli)
    assert f"{chats}:5: not valid UTF-8" in err, err
    assert not run.exists()  # a refused start leaves no run.json
    assert main([*cli, "--data.on_error", "skip"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 malformed record(s), kept 30" in err and f"{chats}:5: not valid UTF-8" in err, err
    assert json.loads((run / "metrics.json").read_text())["data_skipped_records"] == 1


class SignalInFinalValidation(Callback):
    """Sends this process `signum` at the first batch of the validation after the run's last step
    (`last_step` of a max_steps run, else the last epoch's)."""

    def __init__(self, signum, last_step):
        self.signum, self.last_step, self.sent = signum, last_step, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        last = (
            trainer.global_step == self.last_step
            if self.last_step
            else trainer.current_epoch == trainer.max_epochs - 1
        )
        if last and not trainer.sanity_checking and not self.sent:
            self.sent, self.step_seen = True, trainer.global_step
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize(
    "signum, flags, last_step",
    [
        (signal.SIGTERM, ["--trainer.max_steps", "3"], 3),  # mid-epoch: the final validation after fit
        (signal.SIGINT, [], None),  # max_epochs 2: the last epoch's own validation, inside fit
        (signal.SIGUSR1, ["--trainer.max_steps", "3"], 3),
    ],
)
def test_a_stop_signal_after_the_last_step_finishes_the_export_and_says_so(
    tmp_path, monkeypatch, capfd, signum, flags, last_step
):
    import functools

    run = tmp_path / "run"
    late = SignalInFinalValidation(signum, last_step)
    monkeypatch.setattr(train_mod, "train_head", functools.partial(train_mod.train_head, callbacks=[late]))
    reached = []  # a signal the run did not handle lands here instead of killing pytest
    guards = {s: signal.signal(s, lambda n, f: reached.append(n)) for s in (signal.SIGTERM, signal.SIGUSR1)}
    sigint = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a shell's `cmd &`
    try:
        code = main(["fit", "--config", DEBUG, "--run.dir", str(run), *flags])
    finally:
        for s, previous in guards.items():
            signal.signal(s, previous)
    out, err = capfd.readouterr()  # the handler's line is written to fd 2
    assert late.sent and not reached and code == 0, (code, reached, out, err)
    name = signal.Signals(signum).name
    assert f"{name} after the last training step: finishing" in err, err
    assert (
        f"head exported to {run / 'head'}" in out and f"{name} arrived after the last training step" in out
    ), out
    assert (run / "head" / "head.safetensors").is_file()
    assert json.loads((run / "metrics.json").read_text())["global_step"] == (last_step or late.step_seen)
    assert signal.getsignal(signal.SIGINT) is sigint  # the handlers are given back
