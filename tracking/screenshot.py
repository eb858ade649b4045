"""`python -m tracking.screenshot`: what a user sees first in the MLflow UI, as a PNG — the runs table
of an experiment, opened by the link the demo prints (`tracking.runs_url`: the Model-training
layout and the saved view `compare heads`), in headless Chromium with a fresh profile (so nothing
a browser remembered from an earlier visit helps).

    python -m sweeps.demo --objective fixture --out /tmp/mtpc-ui      # 5 trials in ~30 s, no training
    python -m tracking.screenshot --tracking-uri sqlite:////tmp/mtpc-ui/mlflow.db \\
        --experiment mtpc-demo --out docs/figures/mlflow_runs.png

It starts `mlflow server` on 127.0.0.1 (a free port) for the store, waits for /health, runs
`chromium --headless --screenshot` on the runs link, and stops the server by its PID (its own
process group). Needs Chromium (Debian: `apt-get install chromium`); exits 2 with one line when it
is missing or the experiment does not exist. Leaves out: anything the tests rely on (tests check
the experiment's tags and the view's columns without a browser: tests/tracking/test_tracking.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tracking.store import TrackingError, experiment_id, sqlite_path
from tracking.views import runs_url

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(uri: str, port: int, log: Path, timeout_s: float = 180.0) -> subprocess.Popen:
    """`mlflow server` for `uri` on 127.0.0.1:`port`, in its own session; returns once /health answers."""
    env = dict(
        os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", PYTHONSAFEPATH="1"
    )  # no import from the cwd
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", uri, "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise TrackingError(f"mlflow server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:  # noqa: S310 (local)
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise TrackingError(f"mlflow server did not answer /health within {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop by PID: the server runs in its own session, so its pid is its process group's id."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def screenshot(browser: str, url: str, out: Path, width: int, height: int, wait_ms: int) -> None:
    """A PNG of `url` after `wait_ms` of virtual time (the UI fetches its runs meanwhile)."""
    with tempfile.TemporaryDirectory(prefix="mtpc-chromium-") as profile:
        cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode != 0 or not out.is_file():
        raise TrackingError(f"{browser} exited with {r.returncode} and no {out}: {r.stderr.strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tracking.screenshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tracking-uri", required=True, help="the store, e.g. sqlite:///runs/demo/mlflow.db")
    ap.add_argument("--experiment", default="mtpc-demo", help="experiment name (default mtpc-demo)")
    ap.add_argument("--out", default="mlflow_runs.png", help="PNG to write (default mlflow_runs.png)")
    ap.add_argument(
        "--size",
        default="2900x520",
        help="browser window WIDTHxHEIGHT in px (default 2900x520: the 12 columns beside the assistant panel that MLflow opens on a first visit)",
    )
    ap.add_argument(
        "--wait-ms", type=int, default=20000, help="virtual time the page gets to load (default 20000)"
    )
    a = ap.parse_args(argv)
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        print(
            f"error: no Chromium found (looked for {', '.join(BROWSERS)}); on Debian: apt-get install chromium",
            file=sys.stderr,
        )
        return 2
    try:
        width, height = (int(v) for v in a.size.lower().split("x"))
    except ValueError:
        print(f"error: --size {a.size!r}: expected WIDTHxHEIGHT, e.g. 2900x520", file=sys.stderr)
        return 2
    db = sqlite_path(a.tracking_uri)
    if db is not None and not db.is_file():
        print(f"error: no MLflow database at {db} (--tracking-uri {a.tracking_uri})", file=sys.stderr)
        return 2
    exp = experiment_id(a.tracking_uri, a.experiment)
    if exp is None:
        print(f"error: no experiment {a.experiment!r} at {a.tracking_uri}", file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = runs_url(f"http://127.0.0.1:{port}", exp)
    with tempfile.TemporaryDirectory(prefix="mtpc-mlflow-ui-") as tmp:
        log = Path(tmp) / "server.log"
        try:
            proc = start_server(a.tracking_uri, port, log)
            try:
                screenshot(browser, url, out, width, height, a.wait_ms)
            finally:
                stop_server(proc)
        except TrackingError as e:
            tail = log.read_text(errors="replace")[-1500:] if log.is_file() else ""
            print(f"error: {e}\n{tail}", file=sys.stderr)
            return 1
    print(f"{url}\n-> {out} ({out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
