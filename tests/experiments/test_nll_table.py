"""experiments/training/nll_table.py on the shipped default model: one (kind, n) trains, exports its head,
appends its row (read from the shipped model's record, not a cache that no longer holds it) and
the table prints it; training leaves the process's MLflow tracking URI as it found it."""

from __future__ import annotations

import json
import os

import pytest

import experiments.training.nll_table as nt


def test_run_one_exports_a_head_and_writes_its_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default MLflow store, sqlite:///<cwd>/mlflow.db, under tmp
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(nt, "RESULTS", tmp_path / "nll.jsonl")
    monkeypatch.setattr(nt, "PROJECT_DIR", tmp_path)  # run dirs under tmp
    monkeypatch.setattr(nt, "cache_dir", lambda: tmp_path / "cache")  # the head export under tmp
    row = nt.run_one("ff", 4, 8, steps=2)
    assert row["name"] == "default-ff-n4-r1" and row["rank"] == 1 and len(row["val_nll"]) == 4
    assert (tmp_path / "cache" / "heads" / "default-ff-n4-r1" / "head.safetensors").is_file()
    shipped = json.loads((nt.SHIPPED_DIR / "pretrain_metrics.json").read_text())
    assert row["backbone_heldout_bpb"] == pytest.approx(shipped["heldout_bits_per_byte"])
    assert json.loads((tmp_path / "nll.jsonl").read_text().splitlines()[-1])["name"] == row["name"]
    assert "| 2 | 0 | ff | 4 | 1 |" in nt.table(tmp_path / "nll.jsonl")
    # training logged to MLflow and left the process's tracking URI as it was: Lightning's logger
    # exports MLFLOW_TRACKING_URI, which outranks every configured URI for the rest of the process
    assert row["mlflow_run_id"] and (tmp_path / "mlflow.db").is_file()
    assert "MLFLOW_TRACKING_URI" not in os.environ
