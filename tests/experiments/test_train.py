"""Training entry tests on the CPU debug config (tiny in-process Llama, generated chats).

Covers: every shipped YAML parses into a TrainConfig (which round-trips) and validates without
weights; bad configs are rejected with the key and file named; a trial's window is one field,
checked once; remote-code backbones need consent in the config; the CLI's errors (bad key, missing
config file, malformed data) are one line; data.on_error: skip drops and counts records; a debug
fit of each circuit kind with lora_depth 0 and 1 lowers the loss (and LoRA trains only in stage 2);
a run killed mid-epoch resumes exactly (same losses step for step); the exported head reloads to
the same outputs; MLflow gets params, artifacts and metrics; the CLI runs end to end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from experiments.train import main
from experiments.training.config import CONFIG_DIR, TRAIN_CONFIGS, TrainConfig, load_config
from experiments.training.fit import check_config, train_head
from mtpc.names import CIRCUIT_KINDS
from tests.backbone_helpers import tiny_llama

SHIPPED = [CONFIG_DIR / f"{name}.yaml" for name in TRAIN_CONFIGS]


class InjectedCrash(RuntimeError):
    """Stands for a killed job (KeyboardInterrupt would make Lightning call sys.exit)."""


class Recorder(Callback):
    """Records (global_step, loss) after every optimizer step and LoRA snapshots at epoch ends."""

    def __init__(self, crash_at: int | None = None):
        self.losses: dict[int, float] = {}
        self.lora_at_epoch_end: list[list[torch.Tensor]] = []
        self.crash_at = crash_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])
        if self.crash_at is not None and trainer.global_step == self.crash_at:
            raise InjectedCrash(f"injected crash at step {trainer.global_step}")

    def on_train_start(self, trainer, pl_module):
        self.lora_at_start = [p.detach().clone() for p in pl_module.lora_params]

    def on_train_epoch_end(self, trainer, pl_module):
        self.lora_at_epoch_end.append([p.detach().clone() for p in pl_module.lora_params])


def test_shipped_configs_parse_and_validate():
    assert all(p.is_file() for p in SHIPPED)
    for path in SHIPPED:
        typed = load_config(path)
        assert isinstance(typed, TrainConfig) and typed.source == str(path)
        assert load_config(typed.to_dict()) == typed  # the YAML layout round-trips
        cfg = check_config(path)
        assert cfg["model"]["circuit"] in CIRCUIT_KINDS, path
        assert cfg["run"]["dir"] and cfg["run"]["export_dir"], path
    eva = check_config(CONFIG_DIR / "evabyte.yaml")["model"]  # EvaByte ships its own code: consent, pinned
    assert eva["trust_remote_code"] is True and re.fullmatch(r"[0-9a-f]{40}", eva["revision"])
    paper = check_config(CONFIG_DIR / "llama_byte.yaml")
    d, t, m = paper["data"], paper["trainer"], paper["model"]
    assert d["seq_len"] == 8192 and m["lr"] == 3e-4
    assert d["seq_len"] * d["batch_size"] * t["accumulate_grad_batches"] == 2**21  # ~2M bytes per step
    assert t["max_epochs"] == m["lora_start_epoch"] + 1  # one head epoch, then one with LoRA


@pytest.mark.parametrize(
    "override, key",
    [
        ({"model.circuit": "mlp"}, "model.circuit"),
        ({"model.window": 1}, "model.window"),
        ({"model.rank": 0}, "model.rank"),
        ({"model.rank": 2048}, "model.rank"),  # the head's bound (mtpc.names), not a looser one
        ({"model.circuit": "ff"}, "model.rank"),  # debug.yaml's rank 4: ff with r != 1 is an error
        ({"model.lora_depth": 3}, "model.lora_depth"),  # the tiny backbone has 2 layers
        ({"model.backbone": "./no/such/model"}, "model.backbone"),
        ({"model.backbone": "nonsense"}, "model.backbone"),
        ({"data.source": "/no/such/chats.jsonl"}, "data.source"),
        ({"data.seq_len": 4}, "data.seq_len"),
        ({"model.lora_depth": 1, "model.lora_start_epoch": 2}, "model.lora_start_epoch"),
        ({"model.window": "eight"}, "model.window"),  # a type error from the parser
    ],
)
def test_bad_config_names_key_and_file(override, key):
    with pytest.raises(ValueError) as err:
        check_config(CONFIG_DIR / "debug.yaml", override)
    assert key in str(err.value) and "debug.yaml" in str(err.value), str(err.value)


def test_cli_bad_config_exits_2(capsys):
    rc = main(["fit", "--config", str(CONFIG_DIR / "debug.yaml"), "--model.circuit", "mlp"])
    assert rc == 2
    assert "model.circuit" in capsys.readouterr().err


def test_cli_missing_config_file_is_one_line(capsys):
    rc = main(["fit", "--config", "/no/such/train.yaml", "--model.window", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err  # the message, not the usage text first
    assert err.startswith("error: ") and "/no/such/train.yaml" in err, err


def test_window_is_one_field_checked_once(tmp_path, monkeypatch):
    """A sweep point's window reaches the head as ModelConfig.window (set by dataclasses.replace) and is
    checked once, by the training config, naming file and key; the head's constructor keeps its own
    invariant (mtpc.heads). Nothing else re-validates it on the way."""
    import mtpc.heads
    import mtpc.names
    from experiments.training.trial import trial_config

    calls, real = [], mtpc.names.check_architecture

    def counting(*args, **kwargs):
        calls.append(kwargs.get("where", "<head>"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mtpc.names, "check_architecture", counting)
    monkeypatch.setattr(mtpc.heads, "check_architecture", counting)
    cfg = trial_config(
        load_config("debug", {"trainer": {"max_steps": 1}}),
        {"circuit": "hmm", "rank": 2, "window": 5, "lora_depth": 0},
        run_dir=tmp_path,
    )
    assert calls == [] and cfg.model.window == 5  # building the trial's config checks nothing yet
    res = train_head(replace(cfg, run=replace(cfg.run, tracking=False)))
    assert res.model.head.config.window == 5
    assert calls == [f"{CONFIG_DIR / 'debug.yaml'}: model.", "<head>"], calls


def test_remote_code_backbone_needs_consent_in_the_config(tmp_path):
    tiny_llama(vocab=320, hidden=16, layers=2, heads=2, kv_heads=1, dtype=torch.float32).save_pretrained(
        tmp_path / "bb"
    )
    cfg = json.loads((tmp_path / "bb" / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}  # it ships its own modelling file
    (tmp_path / "bb" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"debug\.yaml: model\.trust_remote_code: .*own modelling code.*model\.revision"
    ):
        check_config("debug", {"model.backbone": str(tmp_path / "bb")})
    check_config(
        "debug", {"model.backbone": str(tmp_path / "bb"), "model.trust_remote_code": True}
    )  # local: consent
    with pytest.raises(ValueError, match=r"debug\.yaml: model\.revision: .*40-hex commit hash"):
        check_config("debug", {"model.backbone": "some-org/some-model", "model.trust_remote_code": True})


def test_cli_malformed_data_is_one_line_or_skipped_and_counted(tmp_path, capsys):
    from experiments.training.datamodule import debug_conversations

    lines = [json.dumps(c) for c in debug_conversations(30)]
    lines.insert(3, "{not json")  # line 4
    lines.insert(9, json.dumps({"id": "empty", "messages": []}))  # line 10
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(lines) + "\n")
    cli = [
        "fit",
        "--config",
        str(CONFIG_DIR / "debug.yaml"),
        "--data.source",
        str(chats),
        "--run.dir",
        str(tmp_path / "run"),
        "--trainer.max_steps",
        "2",
    ]
    assert main(cli) == 2  # data.on_error: raise (the default)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{chats}:4" in err and len(err.splitlines()) == 1, err
    assert main([*cli, "--data.on_error", "skip"]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 malformed record(s), kept 30" in err, err
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["data_skipped_records"] == 2


@pytest.mark.parametrize("lora_depth", [0, 1])
@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
def test_debug_fit_lowers_loss(tmp_path, kind, lora_depth):
    rec = Recorder()
    over = {"model.circuit": kind, "model.lora_depth": lora_depth} | (
        {"model.rank": 1} if kind == "ff" else {}
    )
    res = train_head("debug", over, run_dir=tmp_path, callbacks=[rec])
    steps = sorted(rec.losses)
    first = sum(rec.losses[s] for s in steps[:3]) / 3
    last = sum(rec.losses[s] for s in steps[-3:]) / 3
    assert last < 0.8 * first, (kind, lora_depth, first, last)
    assert res.metrics["val_loss"] < first
    assert (res.head_dir / "config.json").exists()
    if lora_depth:  # stage 1 (epoch 0) leaves LoRA untouched, stage 2 trains it
        start, (end0, end1) = rec.lora_at_start, rec.lora_at_epoch_end
        assert start and len(start) == len(end0) == len(end1)
        assert all(torch.equal(a, b) for a, b in zip(start, end0, strict=True))  # stage 1: frozen
        assert any(not torch.equal(a, b) for a, b in zip(end0, end1, strict=True))  # stage 2: trained
    else:
        assert not (res.head_dir / "lora.safetensors").exists()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted debug run (cp, k = 1) with a checkpoint every step."""
    rec = Recorder()
    res = train_head(
        "debug",
        {"model.lora_depth": 1, "run.checkpoint_every_n_steps": 1},
        run_dir=tmp_path_factory.mktemp("ref"),
        callbacks=[rec],
    )
    return rec.losses, res


@pytest.mark.parametrize("epoch", [0, 1])  # mid-epoch 0 (head only) and mid-epoch 1 (head + LoRA)
def test_resume_after_crash_is_exact(tmp_path, reference_run, epoch, monkeypatch):
    ref_losses, ref = reference_run
    n_steps = max(ref_losses)
    per_epoch = n_steps // 2
    assert per_epoch >= 4
    crash_at = epoch * per_epoch + per_epoch // 2 + 1
    track = epoch == 1  # MLflow in one of the two (a fresh sqlite store costs seconds)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    over = {"model.lora_depth": 1, "run.checkpoint_every_n_steps": 1, "run.tracking": track}
    first = Recorder(crash_at=crash_at)
    with pytest.raises(InjectedCrash):
        train_head("debug", over, run_dir=tmp_path / "run", callbacks=[first])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved_step = torch.load(last, weights_only=True)["global_step"]
    assert 0 < saved_step <= crash_at  # the crash may come before that step's checkpoint is written
    second = Recorder()
    res = train_head("debug", over, run_dir=tmp_path / "run", callbacks=[second], ckpt_path="last")
    assert min(second.losses) == saved_step + 1 and max(second.losses) == n_steps  # same step count
    for step in range(saved_step + 1, n_steps + 1):
        assert second.losses[step] == ref_losses[step], (step, second.losses[step], ref_losses[step])
    for name, p in res.model.head.state_dict().items():
        torch.testing.assert_close(p, ref.model.head.state_dict()[name], rtol=0, atol=0)
    if not track:
        return

    # the resumed run logged into the same MLflow run, with params, artifacts and metrics
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(res.mlflow_run_id)
    assert (tmp_path / "run" / "mlflow_run_id.txt").read_text().strip() == res.mlflow_run_id
    for key in (
        "backbone",
        "circuit",
        "window",
        "rank",
        "lora_depth",
        "seed",
        "lr",
        "seq_len",
        "trust_remote_code",
        "revision",
    ):
        assert key in run.data.params, key
    assert run.data.params["circuit"] == "cp" and run.data.params["lora_depth"] == "1"
    assert {"train_loss", "val_loss", "val_nll_1", "val_bits_per_byte", "peak_mem_bytes"} <= set(
        run.data.metrics
    )
    history = client.get_metric_history(res.mlflow_run_id, "train_loss")
    assert {m.step for m in history} >= set(range(n_steps))  # Lightning logs step s as s - 1
    artifacts = {a.path for a in client.list_artifacts(res.mlflow_run_id, "run")}
    assert {"run/config.yaml", "run/git_sha.txt", "run/package_versions.json"} <= artifacts


def test_export_reloads_to_same_outputs(reference_run):
    from mtpc.heads import load_head

    _, res = reference_run
    head, lora = load_head(res.head_dir)
    e = torch.randn(3, res.model.backbone.hidden_size)
    with torch.no_grad():
        want, got = res.model.head(e), head(e)
    assert set(want) == set(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    sd = res.model.backbone.lora_state_dict()
    assert lora is not None and set(lora) == set(sd)
    for name in sd:
        torch.testing.assert_close(lora[name], sd[name], rtol=0, atol=0)
    assert head.config.lora_depth == 1 and head.config.kind == "cp"


@pytest.mark.slow  # two fresh interpreters importing Lightning: ~20 s idle, ~60 s on the loaded 2-core CPU
def test_cli_fit_then_resume_with_ckpt_path_last(tmp_path):
    root = Path(__file__).resolve().parents[2]
    base = [
        sys.executable,
        "-m",
        "experiments.train",
        "fit",
        "--config",
        str(CONFIG_DIR / "debug.yaml"),
        "--run.dir",
        str(tmp_path / "cli"),
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        base + ["--trainer.max_steps", "3"], cwd=root, capture_output=True, text=True, timeout=170, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "cli" / "head" / "head.safetensors").exists()
    assert torch.load(tmp_path / "cli" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    out = subprocess.run(
        base + ["--trainer.max_steps", "5", "--ckpt_path", "last"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Restoring states from the checkpoint" in out.stdout + out.stderr
    assert torch.load(tmp_path / "cli" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5


class SignalAt(Callback):
    """Sends this process SIGUSR1 at a given step, like SLURM's --signal=USR1 before pre-emption."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_sigusr1_checkpoints_stops_and_resumes_exactly(tmp_path, reference_run):
    ref_losses, _ = reference_run
    n_steps = max(ref_losses)
    stop_at = n_steps // 2 - 1  # mid-epoch 0
    over = {"model.lora_depth": 1}
    res = train_head("debug", over, run_dir=tmp_path, callbacks=[SignalAt(stop_at)])
    assert res.preempted and not (res.head_dir / "head.safetensors").exists()
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert saved in (stop_at, stop_at + 1)  # at the first optimizer-step boundary after the signal
    rec = Recorder()
    res = train_head("debug", over, run_dir=tmp_path, callbacks=[rec], ckpt_path="last")
    assert not res.preempted and (res.head_dir / "head.safetensors").exists()
    assert sorted(rec.losses) == list(range(saved + 1, n_steps + 1))
    assert all(rec.losses[s] == ref_losses[s] for s in rec.losses)


def test_max_steps_run_continues_exactly(tmp_path, reference_run):
    """A run stopped by max_steps mid-epoch (between checkpoints) continues exactly with more steps."""
    ref_losses, _ = reference_run
    stop = max(ref_losses) // 2 - 1
    over = {"model.lora_depth": 1, "run.checkpoint_every_n_steps": 0}
    train_head("debug", {**over, "trainer.max_steps": stop}, run_dir=tmp_path)
    rec = Recorder()
    train_head("debug", over, run_dir=tmp_path, callbacks=[rec], ckpt_path="last")
    assert sorted(rec.losses) == list(range(stop + 1, max(ref_losses) + 1))
    assert all(rec.losses[s] == ref_losses[s] for s in rec.losses)


def test_head_validation_chats_are_pretraining_heldout_chats(tmp_path):
    """One split hash for the suite: a custom JSONL split for head validation (val_fraction <= 0.1)
    holds out a subset of what pre-training held out, whole chats on one side."""
    from experiments.training.datamodule import load_split
    from mtpc.data import chat_key, is_heldout

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"id": f"chat{i}_{j}", "messages": msgs}) + "\n" for i in range(300) for j in range(2)
        )
    )
    train, val, skipped = load_split(str(chats), 0.05)
    assert skipped == 0 and 10 < len(val) < 60 and len(train) + len(val) == 600
    assert all(is_heldout(c["id"]) for c in val)  # never a chat the default model trained on
    assert {chat_key(c["id"]) for c in train}.isdisjoint(chat_key(c["id"]) for c in val)
