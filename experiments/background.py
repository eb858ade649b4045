"""Run a command as pausable background work: the command line of the pause protocol.

    python -m experiments.background run [--nice N] [--what LABEL] -- CMD ARGS...
    python -m experiments.background status

`run` registers this process as pausable background work (the lock inherited across `exec`), lowers
its priority and becomes CMD: the suite's timers stop it (SIGSTOP) while they time and continue it
afterwards. `status` says who holds the timing lock and which registrants a timer would pause.
Leaves out: the timing lock and the protocol themselves (experiments/plumbing/timing_lock.py).
"""

from __future__ import annotations

import sys

from experiments.plumbing import timing_lock as tl


def main(args: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m experiments.background",
        description="Run a command as pausable background work: at the lowest CPU "
        "priority, stopped while anything in the suite times.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run CMD registered (the suite's timers pause it)")
    run.add_argument("--what", default=None, help="a label for messages (default: the command)")
    run.add_argument(
        "--nice", type=int, default=19, help="CPU niceness added (default 19: the lowest priority)"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    sub.add_parser("status", help="who holds the timing lock, and which registrants a timer would pause")
    a = ap.parse_args(args)
    if a.cmd == "status":
        print(
            f"timing lock {tl.timing_lock_path()}: "
            + ("; ".join(tl.describe(p) for p in tl.lock_holders()) or "free")
        )
        pids = tl.registered()
        print(
            f"pausable background work ({tl.pausable_dir()}): "
            + ("; ".join(tl.describe(p) for p in pids) or "none")
        )
        return 0
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("run: expected a command after --")
    tl.run_registered(command, a.what, nice=a.nice)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
