"""The machine-wide timing lock's two holds: `timing()` exclusive, `heavy()` shared (experiments.plumbing.timing_lock).

Heavy untimed work (the offline acceptance's decoding) must never run beside a timer, but two of it and
training run side by side; a timer waiting for heavy work goes before heavy work asked for after it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

from experiments.plumbing import timing_lock

HOLD = """import sys, time
from pathlib import Path
from experiments.plumbing.timing_lock import {what}
with {what}({arg}):
    print("held", time.time(), flush=True)
    while not Path(sys.argv[1]).exists():
        time.sleep(0.02)
    time.sleep(float(sys.argv[2]))
    print("releasing", time.time(), flush=True)  # the last moment it surely holds the lock
"""


@pytest.fixture
def lock_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPC_TIMING_LOCK", str(tmp_path / "timing.lock"))
    monkeypatch.delenv(timing_lock.TIMER_ENV, raising=False)
    return {**os.environ, "MTPC_TIMING_LOCK": str(tmp_path / "timing.lock")}


def _start(env, what: str, release, linger: float = 0.0):
    arg = "progress=True" if what == "timing" else ""
    return subprocess.Popen([sys.executable, "-c", HOLD.format(what=what, arg=arg), str(release), str(linger)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _exclusive_free() -> bool:
    fd = timing_lock._flock(timing_lock.timing_lock_path(), fcntl.LOCK_EX, wait=False)
    if fd is None:
        return False
    timing_lock._unlock(fd)
    return True


def test_heavy_blocks_share_the_lock_and_keep_timers_out(lock_env, tmp_path):
    release = tmp_path / "release"
    other = _start(lock_env, "heavy", release)
    try:
        assert other.stdout.readline().startswith("held")
        t = time.monotonic()
        with timing_lock.heavy():  # a second heavy block: at once
            assert time.monotonic() - t < 2.0
            assert timing_lock.wait_while_timing() < 0.5  # training is not held up
        assert not _exclusive_free()  # but no timer may start
        release.touch()
        assert other.stdout.readline().startswith("releasing")
    finally:
        release.touch()
        other.wait(timeout=60)
    assert _exclusive_free()


def test_training_waits_for_a_timer_not_for_heavy_work(lock_env, tmp_path):
    release = tmp_path / "release"
    timer = _start(lock_env, "timing", release, linger=0.0)
    try:
        assert timer.stdout.readline().startswith("held")
        code = (
            "from experiments.plumbing.timing_lock import wait_while_timing\n"
            "print('waiting', flush=True)\n"
            "print(round(wait_while_timing(), 2), flush=True)"
        )
        waiter = subprocess.Popen(
            [sys.executable, "-c", code], env=lock_env, stdout=subprocess.PIPE, text=True
        )
        assert waiter.stdout.readline().strip() == "waiting"  # imports done: the wait starts now
        time.sleep(1.0)
        assert waiter.poll() is None  # blocked while the timer times
        release.touch()
        assert float(waiter.communicate(timeout=60)[0]) >= 0.9
    finally:
        release.touch()
        timer.wait(timeout=60)


def test_a_waiting_timer_goes_before_heavy_work_asked_for_after_it(lock_env, tmp_path):
    r1, r2, r3 = tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"
    first = _start(lock_env, "heavy", r1)
    procs = [first]
    try:
        assert first.stdout.readline().startswith("held")
        timer = _start(lock_env, "timing", r2, linger=0.5)
        procs.append(timer)
        assert "waiting for the timing lock" in timer.stderr.readline()  # it now holds the gate
        late = _start(lock_env, "heavy", r3)
        procs.append(late)
        r2.touch(), r3.touch()  # both let go as soon as they hold
        time.sleep(0.5)
        assert late.poll() is None  # the late heavy block waits behind the waiting timer
        r1.touch()
        t_held, t_released = (float(timer.stdout.readline().split()[1]) for _ in range(2))
        late_held = float(late.stdout.readline().split()[1])
        assert late_held >= t_released > t_held  # the timer ran alone, then the late block
    finally:
        for r in (r1, r2, r3):
            r.touch()
        for p in procs:
            p.wait(timeout=60)


def test_timing_inside_heavy_is_refused_and_heavy_inside_timing_nests(lock_env):
    with timing_lock.heavy():
        with pytest.raises(RuntimeError, match="inside heavy"):
            with timing_lock.timing():
                pass
    with timing_lock.timing():
        with timing_lock.heavy():  # the timer already keeps everyone else out
            assert not _exclusive_free()
    assert _exclusive_free()
