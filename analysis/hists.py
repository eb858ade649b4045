"""The accepted-length histogram artifact (`accepted_length_histogram.json`) of evaluation runs:
parse its forms, download it for the runs a figure shows, and derive from it the drafts tested at
each window position. No DataFrame, no plotting.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tracking import short
from tracking.schema import HISTOGRAM_ARTIFACT


def parse_hist(data: Any) -> np.ndarray:
    """Counts indexed by accepted length from the artifact's JSON.

    Accepted forms: a list of counts ``[c0, c1, ...]``; a mapping ``{"0": c0, "3": c3}``; or
    either of those under a key ``"accepted_length_histogram"`` (what `tracking.log_evaluation`
    writes) / ``"counts"`` / ``"hist"``. Raises ValueError otherwise."""
    if isinstance(data, Mapping):
        for key in ("accepted_length_histogram", "counts", "hist", "histogram"):
            if key in data:
                return parse_hist(data[key])
        try:
            items = {int(k): float(v) for k, v in data.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"{HISTOGRAM_ARTIFACT}: expected a list of counts or a mapping length -> count, got keys "
                f"{list(data)[:5]}"
            ) from None
        if not items:
            return np.zeros(0)
        if min(items) < 0:
            raise ValueError(f"{HISTOGRAM_ARTIFACT}: negative accepted length {min(items)}")
        out = np.zeros(max(items) + 1)
        for k, v in items.items():
            out[k] = v
        return out
    if isinstance(data, list) and all(isinstance(v, (int, float)) for v in data):
        return np.asarray(data, dtype=float)
    raise ValueError(f"{HISTOGRAM_ARTIFACT}: expected a list of counts or a mapping length -> count")


def load_hists(client, run_ids: list[str]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Accepted-length counts per run id for the runs that have the artifact (others left out),
    and one message per artifact that could not be read."""
    from tqdm import tqdm

    out: dict[str, np.ndarray] = {}
    problems: list[str] = []
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"  # one bar of ours, not one per downloaded file
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bar = tqdm(run_ids, desc="histograms", unit="run", disable=len(run_ids) < 50, leave=False)
            for i, run_id in enumerate(bar):
                try:
                    if HISTOGRAM_ARTIFACT not in {f.path for f in client.list_artifacts(run_id)}:
                        continue
                    dst = Path(tmp) / str(i)
                    dst.mkdir()
                    path = client.download_artifacts(run_id, HISTOGRAM_ARTIFACT, str(dst))
                    out[run_id] = parse_hist(json.loads(Path(path).read_text()))
                except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
                    problems.append(f"run {run_id}: {HISTOGRAM_ARTIFACT} unreadable: {short(exc)}")
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
    return out, problems


def drafts_tested(hist: np.ndarray, window: int, extra_token: str = "keep") -> np.ndarray:
    """Drafts tested at each window position 1..n (index 0 = position 1) from the counts of
    accepted lengths s, by the decoding loop's rule (mtpc/speculative/loop.py): with extra_token
    keep, a cycle that accepts s drafts tested positions 2..min(s + 2, n); with drop, positions
    1..min(s + 1, n). So position i was tested by the cycles with s >= i - 2 (keep) or
    s >= i - 1 (drop); a position never tested counts 0."""
    h = np.zeros(window + 2)
    k = min(len(hist), window + 1)
    h[:k] = np.asarray(hist, dtype=float)[:k]
    at_least = np.cumsum(h[::-1])[::-1]  # at_least[j] = cycles with s >= j
    shift = 2 if extra_token == "keep" else 1
    out = np.zeros(window)
    for i in range(1, window + 1):
        j = i - shift
        if extra_token == "keep" and i == 1:
            continue  # position 1 is the verifier's own byte: never a tested draft
        out[i - 1] = at_least[max(j, 0)]
    return out
