"""Pre-training the embedded default: shipped configs validate, a tiny run saves a loadable model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import experiments.pretrain as pt
from experiments.pretraining.config import CONFIGS, PretrainConfig, load_config
from experiments.pretraining.files import METRICS_FILE, STATE_FILE
from experiments.pretraining.loop import pretrain
from mtpc.backbones import load_backbone
from mtpc.tokenizer import VOCAB_SIZE, ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_context=128,
    seq_len=32,
    batch_size=4,
    max_steps=6,
    warmup_steps=2,
    heldout_rows=4,
    max_minutes=2.0,
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS[name])
    assert cfg.hidden_size >= 512 and cfg.num_layers >= 4
    assert cfg.llama_config().vocab_size == VOCAB_SIZE


def test_bad_configs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("hidden_size: 512\nwidth: 3\n")
    with pytest.raises(ValueError, match=r"c\.yaml: width: unknown key\(s\) \['width'\]"):
        load_config(path)
    path.write_text("hidden_size: 100\nnum_heads: 8\n")
    with pytest.raises(
        ValueError, match=r"c\.yaml: hidden_size: 100 does not split into num_heads=8 .*; expected"
    ):
        load_config(path)
    path.write_text("seq_len: 9000\n")
    with pytest.raises(ValueError, match="seq_len: 9000 exceeds max_context=4096; expected"):
        load_config(path)
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(SystemExit):  # argparse error naming the bad override
        pt.main(["--config", "cpu", "--set", "max_minutes=-1", "--out", str(tmp_path / "m")])
    assert load_config(CONFIGS["cpu"], max_minutes=30).max_minutes == 30


def _corpus(path, n=60):
    rows = []
    for i in range(n):
        msgs = [
            {"role": "user", "content": f"count to {i % 7}"},
            {"role": "assistant", "content": "1 2 3 4 5 6 7"[: 2 * (i % 7) + 1]},
        ]
        rows.append(json.dumps({"id": f"c{i}_0", "messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_tiny_pretrain_saves_a_loadable_backbone(tmp_path, monkeypatch):
    cfg = PretrainConfig(**TINY, train_data=str(_corpus(tmp_path / "d.jsonl")))
    out = tmp_path / "model"
    metrics = pretrain(cfg, out)
    assert metrics["steps"] == 6 and 0 < metrics["heldout_bits_per_byte"] < 10
    assert {"model.safetensors", "config.json", "tokenizer_config.json", METRICS_FILE} <= {
        p.name for p in out.iterdir()
    }
    bb = load_backbone(str(out), lora_depth=1)
    assert isinstance(bb.tokenizer, ByteTokenizer) and bb.vocab_size == VOCAB_SIZE and bb.eos_token_id == 258
    ids = torch.tensor([bb.tokenizer.render_prompt("count to 3")])
    assert bb.stp_logits(bb(ids).verify_hidden).shape == (1, ids.shape[1], VOCAB_SIZE)
    assert metrics["loss_curve"] and metrics["loss_curve"][-1]["step"] == 6 and metrics["git_sha"]
    # make pretrain's default output is reported, not retrained, unless --force
    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path / "cache"))
    made = tmp_path / "cache" / "models" / "pretrained"
    made.parent.mkdir(parents=True)
    out.rename(made)
    monkeypatch.setattr(pt, "pretrain", lambda *a, **k: pytest.fail("retrained an existing model"))
    assert pt.main(["--config", "cpu"]) == 0  # reports the existing model and exits


# ---------------------------------------------------------------------------------------------
# exact resume, signals, and the pause that benchmarks take
# ---------------------------------------------------------------------------------------------
def _tiny_yaml(tmp_path, **extra):
    cfg = dict(
        TINY,
        final_seq_len=64,
        final_batch_size=2,
        final_fraction=0.3,
        max_minutes=60.0,
        log_every=2,
        num_threads=1,
        train_data=str(_corpus(tmp_path / "d.jsonl")),
    )
    cfg.update({"max_steps": 14, **extra})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTPC_CACHE_DIR": kw.pop("cache")}
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.pretrain", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_killed_and_resumed_equals_uninterrupted(tmp_path):
    """kill -9 after a mid-run snapshot, start the same command again: the same steps on the same rows
    (both phases), bit for bit the uninterrupted run's weights and loss curve."""
    conf = _tiny_yaml(tmp_path, snapshot_minutes=1e-9, max_steps=30)  # a snapshot after every step
    cache = str(tmp_path / "cache")
    ref = _run(
        ["--config", str(conf), "--out", str(tmp_path / "ref"), "--run-dir", str(tmp_path / "ref_run")],
        cache=cache,
    )
    assert ref.wait(timeout=300) == 0, ref.stdout.read()
    run = tmp_path / "run"
    p = _run(["--config", str(conf), "--out", str(tmp_path / "out"), "--run-dir", str(run)], cache=cache)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (run / STATE_FILE).is_file() and torch.load(run / STATE_FILE, weights_only=True)["state"][
            "step"
        ] >= 5:
            break
        time.sleep(0.05)
    p.send_signal(
        signal.SIGSTOP
    )  # frozen at once (a loaded machine must not let it run to the end), then killed
    p.kill()
    p.wait()
    killed_at = torch.load(run / STATE_FILE, weights_only=True)["state"]["step"]
    assert 5 <= killed_at < 30 and not (tmp_path / "out").exists()
    p = _run(["--config", str(conf), "--out", str(tmp_path / "out"), "--run-dir", str(run)], cache=cache)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and f"resumed {run} at step {killed_at}" in out, out
    a, b = _weights(tmp_path / "ref"), _weights(tmp_path / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = (json.loads((tmp_path / d / METRICS_FILE).read_text()) for d in ("ref", "out"))
    strip = lambda curve: [(c["step"], c["seq_len"], c["train_bits_per_byte"], c["lr"]) for c in curve]
    assert strip(ma["loss_curve"]) == strip(mb["loss_curve"]) and {
        c["seq_len"] for c in ma["loss_curve"]
    } == {32, 64}
    # another config in the same run directory is refused, naming what differs
    conf2 = _tiny_yaml(tmp_path, lr=0.01)
    p = _run(
        ["--config", str(conf2), "--out", str(tmp_path / "o2"), "--run-dir", str(run), "--force"], cache=cache
    )
    out = p.communicate(timeout=300)[0]
    assert p.returncode != 0 and "a snapshot of another run (differs in ['lr'])" in out, out


@pytest.mark.slow
def test_sigterm_snapshots_once_and_exits_nonzero(tmp_path):
    conf = _tiny_yaml(tmp_path, max_steps=100000)
    run = tmp_path / "run"
    p = _run(
        ["--config", str(conf), "--out", str(tmp_path / "out"), "--run-dir", str(run)],
        cache=str(tmp_path / "c"),
    )
    for line in p.stdout:  # wait for the loop to run
        if line.startswith("step 4:"):
            break
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "stopped by signal" in out and "resume by running the same command" in out
    step = torch.load(run / STATE_FILE, weights_only=True)["state"]["step"]
    assert step >= 4 and not (tmp_path / "out").exists()


def test_evaluations_along_the_way_score_at_the_current_row_length(tmp_path):
    """The main phase's evaluations score the held-out bytes at its own row length (a model trained on
    short rows scored at the final length looks flat, which ended runs early); the final ones at the
    final length, which is also what the reported bits/byte use."""
    cfg = PretrainConfig(
        **{**TINY, "max_steps": 8},
        final_seq_len=64,
        final_batch_size=2,
        final_fraction=0.25,
        eval_minutes=1e-9,
        train_data=str(_corpus(tmp_path / "d.jsonl")),
    )
    m = pretrain(cfg, tmp_path / "out")
    lens = [e["seq_len"] for e in m["heldout_curve"]]
    assert lens == [32] * 6 + [64] * 2, lens
    assert m["heldout_curve"][-1]["heldout_bits_per_byte"] == pytest.approx(
        m["heldout_bits_per_byte"], rel=1e-5
    )


def test_work_beside_a_timer_waits_until_it_is_done(tmp_path, monkeypatch):
    """`wait_while_timing()` (what training calls before each batch) returns at once when nobody
    times, and in another process blocks for as long as a timer holds the lock; the timer itself
    never waits on its own lock."""
    from experiments.plumbing import timing_lock

    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MTPC_TIMING_LOCK", str(tmp_path / "timing.lock"))
    assert timing_lock.wait_while_timing() < 0.5
    code = (
        "import time, sys; from experiments.plumbing.timing_lock import wait_while_timing; "
        "t = time.monotonic(); w = wait_while_timing(); print(round(time.monotonic() - t, 2), round(w, 2))"
    )
    env = {**os.environ, "MTPC_TIMING_LOCK": str(tmp_path / "timing.lock")}
    with timing_lock.timing():
        assert timing_lock.wait_while_timing() == 0.0  # the timer's own thread
        waiter = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)
        assert waiter.poll() is None  # still waiting while the timer holds the lock
    out, _ = waiter.communicate(timeout=60)
    elapsed, waited = map(float, out.split())
    assert waited >= 1.0 and elapsed >= waited


def test_what_a_timer_starts_is_part_of_the_timing(tmp_path, monkeypatch):
    """A process started inside `timing()` (a bench timing a training subprocess, whose training calls
    wait_while_timing before each batch) neither waits for its parent's lock nor takes it again; one
    started outside still waits."""
    from experiments.plumbing import timing_lock

    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MTPC_TIMING_LOCK", str(tmp_path / "timing.lock"))
    code = (
        "import time; from experiments.plumbing.timing_lock import timing, wait_while_timing\n"
        "w = wait_while_timing()\n"
        "with timing() as waited:\n    print(round(w, 2), round(waited, 2), flush=True)"
    )
    outside = subprocess.Popen(
        [sys.executable, "-c", code], env=dict(os.environ), stdout=subprocess.PIPE, text=True
    )
    with timing_lock.timing():
        inside = subprocess.run(
            [sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, timeout=60
        )
        assert inside.returncode == 0 and inside.stdout.split() == ["0.0", "0.0"], inside.stderr[-2000:]
        time.sleep(1.0)
        assert outside.poll() is None  # started before the block, not by it: still waiting
    assert timing_lock.TIMER_ENV not in os.environ
    out, _ = outside.communicate(timeout=60)
    assert float(out.split()[0]) >= 0.5


# ---------------------------------------------------------------------------------------------
# reliability: a cut snapshot, a full disk under --out (docs/reliability.md)
# ---------------------------------------------------------------------------------------------
def _one_phase_yaml(tmp_path):
    """A 4-step run on the test process's own thread count (nothing global changes in-process)."""
    return _tiny_yaml(tmp_path, max_steps=4, final_seq_len=None, final_batch_size=None, num_threads=None)


def test_a_truncated_snapshot_is_refused_in_one_line_naming_the_file(tmp_path, capsys):
    """`--run-dir` over a state.pt cut short (a crash of the disk, a copy that stopped): exit 2 and one
    line naming the file, not torch's zip-reader traceback."""
    run = tmp_path / "run"
    args = ["--config", str(_one_phase_yaml(tmp_path)), "--out", str(tmp_path / "out"), "--run-dir", str(run)]
    assert pt.main(args) == 0
    snap = run / STATE_FILE
    snap.write_bytes(snap.read_bytes()[: snap.stat().st_size // 2])
    capsys.readouterr()
    assert pt.main([*args, "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{snap}: not a readable pre-training snapshot" in err[0], err


def _assert_full_disk_reported(rc, err, out):
    assert rc == 74 and len(err) == 1 and f"{out}: no space left on device" in err[0], err
    assert not [p.name for p in out.parent.iterdir() if ".tmp" in p.name] and not out.exists()


def test_out_on_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    """A disk that fills while `--out` is written (ENOSPC injected at write(2) after 20 kB): exit 74,
    one line naming the output and "no space left", no `<out>.tmp<pid>/` left behind."""
    from tests.faults import full_disk

    conf = _one_phase_yaml(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    full_disk(monkeypatch, disk, after=20_000)
    rc = pt.main(["--config", str(conf), "--out", str(disk / "model")])
    _assert_full_disk_reported(rc, capsys.readouterr().err.strip().splitlines(), disk / "model")


def test_out_on_a_real_full_tmpfs_is_one_line_and_leaves_no_temporary(tmp_path, capsys):
    """The same on a real 64 KiB tmpfs (root only; skipped elsewhere): the weights do not fit."""
    from tests.faults import small_tmpfs

    conf = _one_phase_yaml(tmp_path)
    with small_tmpfs("64k") as disk:
        rc = pt.main(["--config", str(conf), "--out", str(disk / "model")])
        _assert_full_disk_reported(rc, capsys.readouterr().err.strip().splitlines(), disk / "model")
