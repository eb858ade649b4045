"""The pause protocol and the timing lock's file (experiments.plumbing.timing_lock).

A timer stops only processes that prove, through the kernel's lock table, that they registered as the
suite's own pausable background work (never a process a file merely names), continues them however it
ends (SIGTERM, SIGKILL), and the lock file is opened without following links, usable by every user."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.plumbing import timing_lock

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)", "experiments.pretrain --background"]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _until(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MTPC_TIMING_LOCK", str(tmp_path / "timing.lock"))
    monkeypatch.delenv(timing_lock.TIMER_ENV, raising=False)
    return {**os.environ}


def _registrant(env) -> subprocess.Popen:
    """`python -m experiments.background run -- <sleeper>`: registered, then exec'd into the sleeper."""
    proc = subprocess.Popen([sys.executable, "-m", "experiments.background", "run", "--", *SLEEP], env=env)
    assert _until(lambda: proc.pid in timing_lock.registered()), "the registrant never showed up"
    return proc


def test_a_registrant_is_stopped_while_timing_and_continued_after_nested_blocks(env):
    reg = _registrant(env)
    try:
        assert Path(f"/proc/{reg.pid}/cmdline").read_bytes().startswith(sys.executable.encode())  # exec'd
        with timing_lock.timing():
            assert _state(reg.pid) == "T"
            with timing_lock.timing():
                assert _state(reg.pid) == "T"
            assert _state(reg.pid) == "T"
        assert _until(lambda: _state(reg.pid) in "SR")
    finally:
        reg.kill()
        reg.wait()
    assert _until(lambda: timing_lock.registered() == [])  # its lock died with it: stale, removed
    assert not list(timing_lock.pausable_dir().glob("*.json"))


def test_a_file_naming_an_unrelated_process_is_never_signalled(env):
    """The first campaign's hole: a pid file naming any process whose command line mentions the
    pre-training was SIGSTOPped. A registry file with the right pid and even the right start time, but
    no lock held by that process, proves nothing."""
    other = subprocess.Popen(SLEEP)
    try:
        assert _until(lambda: _state(other.pid) in "SR")
        folder = timing_lock.pausable_dir()
        folder.mkdir(parents=True)
        record = {"pid": other.pid, "start_time": timing_lock._start_time(other.pid), "what": "forged"}
        (folder / f"{other.pid}.json").write_text(json.dumps(record))
        (Path(os.environ["MTPC_CACHE_DIR"]) / "pretrain.pid").write_text(
            json.dumps({"pid": other.pid})
        )  # old protocol
        assert timing_lock.registered() == []
        with timing_lock.timing():
            time.sleep(0.1)
            assert _state(other.pid) not in "Tt"
    finally:
        other.kill()
        other.wait()


def test_a_lock_held_by_another_process_than_the_one_named_proves_nothing(env, tmp_path):
    """A registry file whose lock is held by one process but which names another (a forged pid inside a
    real registrant's file, or a reused pid) is ignored."""
    other = subprocess.Popen(SLEEP)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, json, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, json.dumps({'pid': int(sys.argv[2]), 'start_time': int(sys.argv[3])}).encode())\n"
            "print('held', flush=True); time.sleep(120)",
            str(tmp_path / "forged.json"),
            str(other.pid),
            str(timing_lock._start_time(other.pid)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        timing_lock.pausable_dir().mkdir(parents=True)
        os.replace(tmp_path / "forged.json", timing_lock.pausable_dir() / f"{other.pid}.json")
        assert timing_lock.registered() == []
        with timing_lock.timing():
            assert _state(other.pid) not in "Tt" and _state(holder.pid) not in "Tt"
    finally:
        for p in (other, holder):
            p.kill()
            p.wait()


def test_several_registrants_pause_together_and_the_in_process_form_registers(env):
    code = (
        "import time; from experiments.plumbing.timing_lock import register\n"
        "with register(None, what='head training'):\n    print('registered', flush=True); time.sleep(120)"
    )
    inproc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    reg = _registrant(env)
    try:
        assert inproc.stdout.readline().strip() == "registered"
        assert sorted(timing_lock.registered()) == sorted([inproc.pid, reg.pid])
        with timing_lock.timing():
            assert _state(inproc.pid) == "T" and _state(reg.pid) == "T"
        assert _until(lambda: _state(inproc.pid) in "SR" and _state(reg.pid) in "SR")
        inproc.terminate()  # killed inside its block: its file stays behind, unlocked, and proves nothing
        inproc.wait()
        assert timing_lock.registered() == [reg.pid]
    finally:
        for p in (inproc, reg):
            p.kill()
            p.wait()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_timer_that_dies_leaves_nothing_stopped(env, how):
    """`timeout`/`kill` (SIGTERM) runs the timer's own SIGCONT; SIGKILL cannot be caught, and the guardian
    the timer started (its own session, reading a pipe only the timer holds) continues the registrant."""
    reg = _registrant(env)
    code = (
        "import time; from experiments.plumbing.timing_lock import timing\n"
        "with timing():\n    print('timing', flush=True); time.sleep(120)"
    )
    timer = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert timer.stdout.readline().strip() == "timing"
        assert _state(reg.pid) == "T"
        timer.send_signal(how)
        timer.wait(timeout=30)
        assert timer.returncode == (128 + signal.SIGTERM if how == signal.SIGTERM else -signal.SIGKILL)
        assert _until(lambda: _state(reg.pid) in "SR", timeout=10)
    finally:
        for p in (reg, timer):
            p.kill()
            p.wait()


def test_the_lock_file_is_created_for_every_user_whatever_the_umask(env):
    old = os.umask(0o022)
    try:
        with timing_lock.timing():
            pass
    finally:
        os.umask(old)
    path = timing_lock.timing_lock_path()
    assert path.stat().st_mode & 0o777 == 0o666
    path.chmod(0o444)  # another user's file, say: a read-only open is all the lock needs
    with timing_lock.timing():
        pass
    with timing_lock.heavy():
        assert timing_lock.wait_while_timing() < 1.0


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_a_lock_path_that_is_not_a_regular_file_is_refused_in_one_line(env, tmp_path, kind):
    path = timing_lock.timing_lock_path()
    target = tmp_path / "victim"
    if kind == "symlink":
        path.symlink_to(target)  # root must not create another user's link target
    elif kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(timing_lock.TimingLockError) as e:
        timing_lock.check_timing_lock()
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "expected a regular file" in msg
    with pytest.raises(timing_lock.TimingLockError):
        with timing_lock.timing():
            pass
    assert not target.exists()


def test_a_waiter_says_who_holds_the_lock_and_leaves_when_asked_to_stop(env, capsys):
    """A hung or stopped evaluation holding the lock no longer stalls training silently: the waiter names
    the holder (and that it is stopped), and a stop request (training's SIGTERM) ends the wait."""
    code = (
        "import os, signal, time; from experiments.plumbing.timing_lock import timing\n"
        "with timing():\n    print('timing', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
    )
    timer = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert timer.stdout.readline().strip() == "timing"
        assert _until(lambda: _state(timer.pid) == "T")
        asked = time.monotonic() + 6.0
        waited = timing_lock.wait_while_timing(should_stop=lambda: time.monotonic() > asked)
        assert 6.0 <= waited < 15.0
        err = capsys.readouterr().err
        assert f"pid {timer.pid}" in err and "stopped" in err and str(timing_lock.timing_lock_path()) in err
        from experiments.training.callbacks import YieldToTimer

        y = YieldToTimer(should_stop=lambda: True)
        t = time.monotonic()
        y.on_train_batch_start(None, None, None, 0)
        assert time.monotonic() - t < 2.0
    finally:
        timer.kill()
        timer.wait()
