"""Synthetic sweeps with known values, logged to an MLflow store, for the analysis tests and the
example figure (no training, no decoding: the numbers are made up but shaped like a real sweep).

`synthetic_evaluations` returns the list of evaluation records (params + metrics + histogram);
`log_sweep` writes them as MLflow parent (trial) runs with one evaluation run per (mode,
prompt_set) through the suite's own writer (`tracking.log_evaluation`, what the evaluator and the
sweep fixture call), so the analysis tests read what real sweeps write. Tests recompute
expectations from the same records.

Example figure: `python -m tests.analysis_helpers /tmp/syn` (as a module: run as a file, tests/tracking/
would shadow the `tracking` package) then
`python -m analysis --tracking-uri sqlite:////tmp/syn/mlflow.db --out /tmp/syn/out`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mtpc.names import CIRCUIT_KINDS

PROMPT_SETS = ("chat", "code", "math")
# head quality (drives mu_acc) and head cost per cycle in ms (drives mu_lat)
_QUALITY = {"ff": 0.45, "cp": 0.62, "hmm": 0.70, "btree": 0.74}
_COST_MS = {"ff": 0.3, "cp": 0.9, "hmm": 1.6, "btree": 1.9}


@dataclass
class Evaluation:
    params: dict[str, object]
    metrics: dict[str, float]
    hist: list[int] | None = None
    status: str = "FINISHED"
    trial: str = ""  # runs with the same trial share a parent
    extra_tags: dict[str, str] = field(default_factory=dict)


def synthetic_evaluations(
    backbone: str = "tiny",
    modes: tuple[str, ...] = ("greedy",),
    circuits: tuple[str, ...] = CIRCUIT_KINDS,
    windows: tuple[int, ...] = (8, 16),
    ranks: tuple[int, ...] = (32,),
    lora_depths: tuple[int, ...] = (0,),
    prompt_sets: tuple[str, ...] = PROMPT_SETS,
    seed: int = 0,
    with_optional: bool = True,
) -> list[Evaluation]:
    """Deterministic synthetic evaluations: one per (config, mode, prompt set)."""
    rng = np.random.default_rng(seed)
    out: list[Evaluation] = []
    stp_lat = 0.020  # s per byte of the plain model
    for mode in modes:
        for c in circuits:
            for n in windows:
                for r in ranks if c != "ff" else (1,):
                    for k in lora_depths:
                        trial = f"{backbone}-{c}-n{n}-r{r}-k{k}"
                        base_q = _QUALITY[c] + 0.04 * k - (0.02 if mode == "sample" else 0.0)
                        base_q = min(base_q + 0.002 * (r - 32) * (c != "ff"), 0.95)
                        for ps in prompt_sets:
                            q = float(np.clip(base_q + rng.normal(0, 0.02), 0.05, 0.97))
                            # acceptance at drafted positions 2..n decays geometrically
                            acc = {i: q ** (1 + 0.15 * (i - 2)) for i in range(2, n + 1)}
                            probs = np.array([acc[i] for i in range(2, n + 1)])
                            # P(accept >= j) = prod_{i<=j} acc
                            surv = np.cumprod(probs)
                            mu_acc = float(surv.sum())
                            lat = stp_lat * 1.05 + 1e-3 * (_COST_MS[c] * (n / 8) * (1 + 0.01 * r)) + 0.002 * k
                            lat *= float(1 + rng.normal(0, 0.01))
                            stp = stp_lat * float(1 + rng.normal(0, 0.01))
                            tpc = mu_acc + 1.0
                            thr = 0.97 * tpc / lat  # measured: not exactly tpc / mu_lat
                            stp_thr = 0.99 / stp
                            pmf = np.append(1 - probs[0], surv[:-1] * (1 - probs[1:]))
                            pmf = np.append(pmf, surv[-1])  # lengths 0..n-1
                            hist = [int(v) for v in np.round(pmf * 1000)]
                            metrics = {
                                "mu_lat": lat, "mu_acc": mu_acc, "tokens_per_cycle": tpc, "throughput": thr,
                                "max_throughput": n / lat, "stp_mu_lat": stp, "stp_throughput": stp_thr,
                                "speedup_vs_stp": thr / stp_thr, "peak_mem_bytes": 1e8 * (1 + 0.1 * n),
                            }  # fmt: skip
                            metrics.update({f"acceptance_pos_{i}": v for i, v in acc.items()})
                            params: dict[str, object] = {
                                "backbone": backbone, "circuit": c, "window": n, "rank": r, "lora_depth": k,
                                "mode": mode, "extra_token": "keep",
                                "temperature": 0.0 if mode == "greedy" else 1.0, "prompt_set": ps, "seed": 0,
                            }  # fmt: skip
                            if with_optional:
                                params["hardware"] = "cpu-test"
                                params["top_p"] = 1.0
                            out.append(Evaluation(params, metrics, hist, trial=f"{mode}-{trial}"))
    return out


def frame_from_evaluations(evaluations: list[Evaluation]):
    """The DataFrame `analysis.load` would build from these runs, without an MLflow store: params
    go through str() as MLflow stores them. Run ids are "run<i>"."""
    from analysis.load import SkippedRun, records_to_frame, run_record

    records = []
    for i, ev in enumerate(evaluations):
        rec = run_record(f"run{i}", ev.trial, "0", {k: str(v) for k, v in ev.params.items()}, ev.metrics)
        assert not isinstance(rec, SkippedRun), rec
        records.append(rec)
    return records_to_frame(records)


def log_sweep(uri: str, experiment: str, evaluations: list[Evaluation]) -> dict[str, str]:
    """Log parent runs (one per trial) and an evaluation run per evaluation with the real writer;
    an evaluation whose `status` is not FINISHED is set to it afterwards (what an interrupted or
    failed attempt leaves). Returns the evaluation run ids by index ("0", "1", ...) plus the
    experiment id under "experiment_id"."""
    import tracking
    from tracking.schema import ACCEPTANCE_PREFIX

    exp_id = tracking.ensure_experiment(uri, experiment)
    client = tracking.client(uri)
    parents: dict[str, str] = {}
    ids: dict[str, str] = {"experiment_id": exp_id}
    for i, ev in enumerate(evaluations):
        if ev.trial not in parents:
            keys = ("backbone", "circuit", "window", "rank", "lora_depth")
            pid = tracking.start_parent_run(
                uri, exp_id, ev.trial, tags={}, params={k: ev.params[k] for k in keys if k in ev.params}
            )
            tracking.log_metrics(uri, pid, {"val_loss": 1.0})
            tracking.terminate(uri, [pid], "FINISHED")
            parents[ev.trial] = pid
        acc = {
            int(k[len(ACCEPTANCE_PREFIX) :]): v
            for k, v in ev.metrics.items()
            if k.startswith(ACCEPTANCE_PREFIX)
        }
        per_pos = [acc.get(j) for j in range(1, max(acc) + 1)] if acc else None
        scalars = {k: v for k, v in ev.metrics.items() if not k.startswith(ACCEPTANCE_PREFIX)}
        rid = tracking.log_evaluation(
            uri,
            parents[ev.trial],
            ev.params,
            scalars,
            per_position_acceptance=per_pos,
            histogram=ev.hist,
            experiment_id=exp_id,
        )
        tracking.set_tags(uri, rid, {"idx": i, **ev.extra_tags})
        if ev.status == "RUNNING":
            client.update_run(rid, status="RUNNING")
        elif ev.status != "FINISHED":
            client.set_terminated(rid, status=ev.status)
        ids[str(i)] = rid
    return ids


def evaluation_result(
    head: str = "shipped",
    *,
    backbone: str = "tiny",
    window: int = 8,
    rank: int = 16,
    modes: tuple[str, ...] = ("greedy",),
    prompt_sets: tuple[str, ...] = ("0", "1"),
    hardware: str = "cpu-test",
    acceptance: str | None = "offline",
    eos: str | None = "banned",
    temperature: float = 0.0,
    mu_lat: float = 0.02,
    mu_acc: float = 1.5,
) -> dict:
    """An `evaluate_heads` result (the shape experiments/evaluation/decoding.py returns) of one btree
    head with known numbers: one run per (mode, prompt set), set i at mu_lat (1 + 0.1 i) and
    mu_acc + 0.2 i; offline (`acceptance`) with the derived throughput beside the measured one.
    `acceptance` / `eos` None leave the key out (a store from before that param)."""
    runs, summary = [], []
    for mode in modes:
        per_set = []
        for i, ps in enumerate(prompt_sets):
            lat, acc = mu_lat * (1 + 0.1 * i), mu_acc + 0.2 * i
            tpc, stp_lat = acc + 1.0, 0.015
            m = {
                "mu_lat": lat, "mu_acc": acc, "tokens_per_cycle": tpc, "throughput": 0.9 * tpc / lat,
                "max_throughput": window / lat, "stp_mu_lat": stp_lat, "stp_throughput": 1 / stp_lat,
                "speedup_vs_stp": 0.9 * tpc / lat * stp_lat, "peak_mem_bytes": 1e8,
                "per_position_acceptance": [None, 0.8, 0.5, 0.3], "accepted_length_histogram": [3, 2, 1, 1],
            }  # fmt: skip
            if acceptance == "offline":
                m.update(derived_throughput=tpc / lat, derived_speedup_vs_stp=tpc / lat * stp_lat)
            run = {
                "head": head, "backbone": backbone, "circuit": "btree", "window": window, "rank": rank,
                "lora_depth": 0, "mode": mode, "extra_token": "keep", "temperature": temperature,
                "top_p": 1.0, "prompt_set": ps, "seed": 0, "metrics": m, "per_prompt": [],
            }  # fmt: skip
            if eos is not None:
                run["eos"] = eos
            if acceptance is not None:
                run["acceptance_method"] = acceptance
            runs.append(run)
            per_set.append(m)
        summary.append({
            "head": head, "mode": mode,
            **{k: {"mean": float(np.mean([m[k] for m in per_set])), "std": 0.0}
               for k in ("mu_lat", "mu_acc", "tokens_per_cycle", "speedup_vs_stp")},
        })  # fmt: skip
    config = {"max_new_tokens": 64, "ff_head": None, "acceptance": acceptance}
    return {"hardware": hardware, "config": config, "stp": {}, "runs": runs, "summary": summary}


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/synthetic")
    root.mkdir(parents=True, exist_ok=True)
    evs = synthetic_evaluations(ranks=(8, 32), lora_depths=(0, 2))
    uri = f"sqlite:///{root.resolve()}/mlflow.db"
    log_sweep(uri, "synthetic", evs)
    print(f"logged {len(evs)} evaluations to {uri} (experiment 'synthetic')")
