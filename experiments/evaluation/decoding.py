"""Evaluate speculative decoding: STP and MtPC heads (and an ff reference) on the same prompts, in one
process, as an `EvalConfig` says (the CLI: experiments/evaluate.py; the sweep trial: experiments/training/trial.py).

    evaluate_heads(models, prompt_sets, evaluation: EvalConfig, *, set_names=, ff_name=, ...) -> a JSON-able dict
    summarize(results)                      mean ± std over prompt sets
    log_evaluation_to_mlflow(results, parent_run_id, ...)

`log_evaluation_to_mlflow` writes one evaluation run per (head, mode, temperature, extra_token, eos,
prompt_set) under a parent run, through `tracking.log_evaluation`: the `tracking.schema.EVAL_PARAMS`
params, the `EVAL_METRICS` metrics, the per-position acceptance as metrics `acceptance_pos_<i>`, the
accepted-length histogram and the per-prompt records as artifacts.

How acceptance is obtained (`eval.acceptance`, the run param `acceptance_method`; a run without it is
online): `offline` (default) computes mu_acc, tokens_per_cycle, the per-position acceptance and the
histogram from the plain model's continuation of every prompt, teacher-forced
(mtpc/speculative/offline.py: greedy exact, cycle for cycle; sampling the loop's expectations, floats)
and times only the first `eval.latency_prompts` prompts of each set through the speculative loop and
STP: mu_lat, max_throughput, `throughput` and speedup_vs_stp are that subset's, measured, and
`derived_throughput` = tokens_per_cycle (offline) / mu_lat (timed) and `derived_speedup_vs_stp` =
derived_throughput / stp_throughput are logged beside them under their own names. Offline is the
keep cycle only: `eval.extra_token: drop` needs `eval.acceptance: online`, which runs every prompt
through the timed loop (as before the offline method existed).

Metric names are `tracking.schema.EVAL_METRICS`. Per prompt set they are pooled over its prompts:
mu_lat = cycle seconds / cycles, mu_acc = accepted drafts / cycles, tokens_per_cycle = bytes
emitted / cycles, throughput = bytes produced by cycles / decode seconds (the prefill and its first
byte excluded, for STP alike), per-position acceptance = accepted / tested at window position i.
Beside them, from the generated answers themselves (mtpc/textstats.py): `degenerate_fraction` (the
share of answers whose last 128 bytes loop with a period <= 32) and `distinct_4gram_ratio`, for
every run and for STP (`stp_degenerate_fraction`, `stp_distinct_4gram_ratio`); a warning is printed
when acceptance comes from degenerate text (degenerate_fraction > 0.25). `eos`: "banned" (EOS gets
probability 0, every method generates max_new_tokens bytes) or "allowed" (EOS stops an answer).

Timing lock: latencies are only comparable when nothing else computes on the same cores, so
`evaluate_heads` holds the machine-wide timing lock (`experiments.plumbing.timing_lock.timing`:
`$MTPC_TIMING_LOCK`, default `<tmp>/mtpc-timing.lock`) from its first timed generation to its last,
with the background pre-training (if any) stopped: sweep workers train in parallel, but one
evaluation (STP and its heads, prompt set by prompt set) times at a time. The offline acceptance
(decoding every prompt of a set) holds the same lock shared per set (`experiments.plumbing.timing_lock.heavy`),
so it never runs beside another evaluation's timed phase either, while other workers keep training
and decoding beside it.

Leaves out: the command line (experiments/evaluate.py), reading prompts (experiments/evaluation/prompts.py),
the pass cache (mtpc/speculative/pass_cache.py), training (experiments/training/), plots (analysis/).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

import tracking
from experiments.evaluation.config import EvalConfig
from experiments.evaluation.prompts import eval_passes
from experiments.plumbing.parsing import Fail
from experiments.plumbing.timing_lock import heavy, timing
from mtpc import MtpcModel
from mtpc.speculative.offline import CONTINUATION_BATCH, pool_offline
from mtpc.textstats import degeneracy_metrics, degenerate
from tracking.runs import machine, machine_line
from tracking.schema import (
    DEGENERACY_METRICS,
    DEGENERATE_WARN_FRACTION,
    EVAL_METRICS,
    EVAL_PARAMS,
    PER_PROMPT_ARTIFACT,
)


def hardware() -> str:
    """A one-line description of where this ran (`tracking.runs.machine_line`)."""
    return machine_line(machine())


# -------------------------------------------------------------------------------------- evaluate


def _answer(model: MtpcModel, ids: torch.Tensor) -> bytes | list[int]:
    """The generated answer as bytes (special ids dropped) when the backbone has a tokenizer, else its ids."""
    tok = model.tokenizer
    return tok.decode(ids.tolist()) if tok is not None else ids.tolist()


def _per_prompt(
    prompts: list[torch.Tensor], stats_list: list[Any], answers: list[bytes | list[int]], set_idx: int
) -> list[dict[str, Any]]:
    """One record per prompt (same order in every run of a set, so runs pair up prompt by prompt);
    `prompt_sha` (of the prompt's ids) lets a reader check that two runs saw the same prompt.
    `accepted` is the accepted drafts summed over the prompt's cycles: a count online, an expectation
    (a float, kept unrounded) offline under sampling, where `cycles` is one too and `decode_s` None
    (nothing was timed)."""
    out = []
    for i, (p, s, a) in enumerate(zip(prompts, stats_list, answers, strict=True)):
        sha = hashlib.sha1(",".join(map(str, p.tolist())).encode()).hexdigest()[:12]
        accepted = (
            s.accepted if hasattr(s, "accepted") else int(round(s.mu_acc * s.cycles))
        )  # online: a count
        out.append({"prompt_set": set_idx, "prompt": i, "prompt_sha": sha, "cycles": s.cycles,
                    "accepted": accepted, "decode_s": getattr(s, "decode_s", None),
                    "decode_generated": s.decode_generated, "degenerate": degenerate(a)})  # fmt: skip
    return out


def _pool(stats_list: list[Any], window: int, answers: list[bytes | list[int]]) -> dict[str, Any]:
    """Pool per-prompt GenerationStats (and the answers) of one prompt set into the set's metrics."""
    cycles = sum(s.cycles for s in stats_list)
    decode_s = sum(s.decode_s for s in stats_list)
    tested = [sum(s.tested_at[i] for s in stats_list) for i in range(window)]
    accepted = [sum(s.accepted_at[i] for s in stats_list) for i in range(window)]
    hist_len = max((len(s.accepted_length_histogram) for s in stats_list), default=0)
    hist = [
        sum(s.accepted_length_histogram[i] for s in stats_list if s.accepted_length_histogram)
        for i in range(hist_len)
    ]
    mu_lat = decode_s / cycles if cycles else float("nan")
    return {
        "mu_lat": mu_lat,
        "mu_acc": sum(s.mu_acc * s.cycles for s in stats_list) / cycles if cycles else float("nan"),
        "tokens_per_cycle": sum(s.tokens_per_cycle * s.cycles for s in stats_list) / cycles
        if cycles
        else float("nan"),
        "throughput": sum(s.decode_generated for s in stats_list) / decode_s if decode_s else float("nan"),
        "max_throughput": window / mu_lat if cycles else float("nan"),
        "peak_mem_bytes": max(s.peak_mem_bytes for s in stats_list),
        "cycles": cycles,
        "generated": sum(s.generated for s in stats_list),
        "backbone_calls": sum(s.backbone_calls for s in stats_list),
        "prefill_s": sum(s.prefill_s for s in stats_list),
        "per_position_acceptance": [a / t if t else None for a, t in zip(accepted, tested, strict=True)],
        "accepted_length_histogram": hist,
        **degeneracy_metrics(answers),
    }


def _describe(model: MtpcModel) -> dict[str, Any]:
    cfg = model.head.config
    return {
        "backbone": str(cfg.backbone or model.backbone.name),
        "circuit": cfg.kind,
        "window": cfg.window,
        "rank": cfg.rank,
        "lora_depth": cfg.lora_depth,
    }


@dataclass(frozen=True)
class EvalJob:
    """One (mode, EOS treatment, prompt set) of an evaluation: STP and every head run it on the same prompts."""

    mode: str
    eos: str
    set_name: Any
    prompts: list[torch.Tensor]


def _generate_one(
    model: MtpcModel, job: EvalJob, i: int, extra_token: str | None, seed: int, kw: dict[str, Any]
) -> Any:
    """Prompt i of the job through `model` (speculative with `extra_token`; None: the plain model),
    sampled with seed + i."""
    ban = job.eos == "banned"
    p = job.prompts[i]
    if extra_token is None:
        return model.generate_plain(p, mode=job.mode, seed=seed + i, ban_eos=ban, **kw)
    return model.generate(p, mode=job.mode, seed=seed + i, extra_token=extra_token, ban_eos=ban, **kw)


def _generate_interleaved(
    runners: list[tuple[MtpcModel, str | None]], job: EvalJob, seed: int, kw: dict[str, Any], bar: Any
) -> list[tuple[list[Any], list[bytes | list[int]]]]:
    """The job's prompts through every runner (model, extra_token; None: the plain model) in interleaved
    rounds — prompt i through all of them before prompt i + 1 — after one short untimed warm-up call
    each, so a drift of the machine's speed during the job falls on STP and every head alike.
    Returns per runner its per-prompt stats and answers (prompt i sampled with seed + i)."""
    if job.prompts:
        warm = dict(kw, max_new_tokens=min(4, kw["max_new_tokens"]))
        for model, extra in runners:
            _generate_one(model, job, 0, extra, seed, warm)
    out: list[tuple[list[Any], list[bytes | list[int]]]] = [([], []) for _ in runners]
    for i in range(len(job.prompts)):
        for (model, extra), (stats, answers) in zip(runners, out, strict=True):
            o = _generate_one(model, job, i, extra, seed, kw)
            stats.append(o.stats)
            answers.append(_answer(model, o.ids))
            bar.update()
    return out


def _decode_config(model: MtpcModel, job: EvalJob, kw: dict[str, Any]) -> Any:
    """The `DecodeConfig` `model.generate` / `generate_plain` use for this job (stop ids as the model sets them)."""
    from mtpc.speculative.loop import DecodeConfig

    stops = tuple(getattr(model.backbone, "stop_token_ids", ()) or ())
    return DecodeConfig(mode=job.mode, ban_eos=job.eos == "banned",
                        eos_id=stops if len(stops) > 1 else model.backbone.eos_token_id, **kw)  # fmt: skip


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise EvaluationStopped("stopped on request between two prompt sets")


def _offline(models: dict[str, MtpcModel], job: EvalJob, seed: int, kw: dict[str, Any], batch: int,
             cache: bool = True) -> tuple[list[list[int]], dict[str, list[Any]]]:  # fmt: skip
    """The plain model's continuations of the job's prompts (prompt i seeded seed + i, as STP) and, per
    head, its offline keep-cycle counts on them: one teacher-forced pass per backbone (heads with
    lora_depth 0 share one), reused by every head on it (mtpc/speculative/offline.py). On the compact
    forward with k = 0 the batched decoding yields that pass as it goes (`decode_and_force`, kept in
    the process for the next evaluation on the same texts: mtpc/speculative/pass_cache.py; its bytes are stored in the
    cache for LoRA heads); otherwise the continuations come from the on-disk cache
    when another evaluation computed them already (mtpc/speculative/continuation_cache.py; `cache`
    False: computed here, nothing stored)."""
    from mtpc.speculative.continuation_cache import cached_continuations, cached_pass
    from mtpc.speculative.offline import fused_pass_applies, offline_acceptance, teacher_force
    from mtpc.speculative.pass_cache import fused_pass

    first = next(iter(models.values()))
    cfg = _decode_config(first, job, kw)
    bb = first.backbone
    batch = (
        batch if getattr(bb, "engine", "hf") == "compact" else 1
    )  # batched decoding needs the compact forward
    seeds = [seed + i for i in range(len(job.prompts))]
    passes: dict[int, Any] = {}
    if fused_pass_applies(bb, batch):  # k = 0: decoding yields the pass too; cheaper than a cache hit's pass
        fused = fused_pass(bb, job.prompts, cfg, seeds, batch, cache)
        passes[id(bb)] = fused
        cached_continuations(bb, job.prompts, cfg, seeds=seeds, batch_size=batch, cache=cache,
                             compute=lambda: fused.continuations)  # fmt: skip  # stored for other evaluations' LoRA heads
        ys = fused.continuations
    else:  # the continuations and their pass, a cache hit checked on that very pass (one pass, not two)
        tf = cached_pass(bb, job.prompts, cfg, seeds=seeds, batch_size=batch, cache=cache)
        passes[id(bb)] = tf
        ys = tf.continuations
    out = {}
    for name, model in models.items():
        key = id(model.backbone)
        if key not in passes:
            passes[key] = teacher_force(model.backbone, job.prompts, ys, _decode_config(model, job, kw))
        # the bytes a cycle feeds, as the timed loop does
        out[name] = offline_acceptance(passes[key], model.head, draft_len=model.draft_len)
    return ys, out


class EvaluationStopped(Exception):
    """`evaluate_heads` saw its `should_stop` turn true between two prompt sets (a sweep worker asked to
    stop): nothing was returned or logged; the evaluation runs again from the start."""


def evaluate_heads(
    models: dict[str, MtpcModel] | MtpcModel,
    prompt_sets: list[list[str | bytes | torch.Tensor]],
    evaluation: EvalConfig,
    *,
    set_names: list[str] | None = None,
    ff_name: str | None = None,
    progress: bool = True,
    evabyte_mtp: bool = False,
    continuation_batch: int = CONTINUATION_BATCH,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run STP and every head on every prompt set in this process, as `evaluation` says (checked by
    `EvalConfig.check`; its prompt-drawing fields are `experiments.evaluation.prompts.eval_prompt_sets`'); returns
    a JSON-able dict: "hardware", "config", "stp" (per mode, its rows), "runs", "summary".

    models: name -> MtpcModel (they may share a backbone), or one MtpcModel (named "head");
    STP runs on the first one's backbone.
    prompt_sets: the prompts (str, bytes or id tensors); set_names: the `prompt_set` value of each set
    (default 0, 1, ...; "dev0" marks development prompts). Every prompt must fit the backbone's
    context with `max_new_tokens` and the largest window: checked before anything decodes (an
    `experiments.evaluation.prompts.Prompt` is named by its file and line).
    ff_name: the key of an ff head in `models`; every other run then gets `speedup_vs_ff`.
    evabyte_mtp: also run the backbone's own multi-byte decoding, greedy (experiments/evaluation/evabyte_mtp.py).
    continuation_batch: offline, at most this many prompts decoded at once for the continuations (compact
        Llama forward; batches of similar length, in groups of similar length on the CPU, also capped at
        `offline.KV_BUDGET_BYTES` of keys and values; default `offline.CONTINUATION_BATCH`).
    should_stop: checked before every prompt set's timed and offline part; when it turns true,
    EvaluationStopped is raised (an evaluation of hundreds of prompts per set takes many minutes, longer
    than a cluster's pre-emption notice).

    From `evaluation`: every (mode, temperature) of `eval_passes` (sampling at each temperature, greedy
    once), each EOS treatment, with `extra_token`; `stp` False skips the plain model (about half the
    time) and leaves out every stp_* metric and speedup_vs_stp. `acceptance` "offline" (EvalConfig's
    default): mu_acc, tokens_per_cycle, the per-position acceptance and the histogram come from the
    plain model's continuation of every prompt, teacher-forced (exact cycles when greedy,
    expectations when sampling; extra_token keep only); only the first `latency_prompts` prompts of
    each set go through the timed loop (and STP), which gives mu_lat, max_throughput, the measured
    `throughput` and speedup_vs_stp of that subset; `derived_throughput` = tokens_per_cycle (offline) /
    mu_lat (timed) and `derived_speedup_vs_stp` = derived_throughput / stp_throughput; the degeneracy
    metrics read the continuations; `continuation_cache` shares them through the on-disk cache
    (mtpc/speculative/continuation_cache.py) or (False) computes them here and stores nothing.
    "online": every prompt through the timed speculative loop.
    Prompt i of a set is sampled with seed + i for STP and every head alike. A model whose `draft_len`
    m is below its window n (a shipped head's decoding default) is evaluated as it decodes: offline
    and timed, a cycle feeds m bytes, and the per-position acceptance and max_throughput are of m.
    Everything timed runs under `experiments.plumbing.timing_lock.timing`: one timer on the machine at a time;
    STP and the heads run each prompt in turn (interleaved rounds, after a short warm-up call each). The
    offline computation runs after it, untimed, and waits while another process times.
    Per temperature the evaluation is a list of `EvalJob`s, one per (mode, eos, prompt set) in that
    order; each runs STP (when `stp`) and then every head.
    """
    if not isinstance(evaluation, EvalConfig):
        raise TypeError(f"evaluation: expected an EvalConfig, got {type(evaluation).__name__}")
    e = evaluation.check(Fail("evaluation"))
    if isinstance(models, MtpcModel):
        models = {"head": models}
    if not models:
        raise ValueError("models: need at least one head")
    if ff_name is not None and ff_name not in models:
        raise ValueError(f"ff_name={ff_name!r} is not one of the models {sorted(models)}")
    if set_names is not None and len(set_names) != len(prompt_sets):
        raise ValueError(f"set_names: {len(set_names)} names for {len(prompt_sets)} prompt sets")
    first = next(iter(models.values()))
    encoded = [[first.encode_prompt(p) for p in ps] for ps in prompt_sets]
    names = list(set_names or range(len(prompt_sets)))
    check_prompt_lengths(models, prompt_sets, encoded, names, e.max_new_tokens)
    results: dict[str, Any] | None = None
    for temperature in e.temperatures:
        modes = tuple(m for m, t in eval_passes(e.modes, e.temperatures) if t == temperature)
        res = _evaluate_at(
            models,
            encoded,
            names,
            e,
            modes,
            temperature,
            ff_name=ff_name,
            progress=progress,
            evabyte_mtp=evabyte_mtp,
            continuation_batch=continuation_batch,
            should_stop=should_stop,
        )
        if results is None:
            results = res
        else:  # one result for the whole evaluation: runs and STP baselines of every temperature
            results["runs"] += res["runs"]
            for mode, rows in res["stp"].items():
                results["stp"].setdefault(mode, []).extend(rows)
    assert results is not None  # EvalConfig.check: at least one temperature
    results["config"].update(modes=list(e.modes), temperatures=list(e.temperatures), stp=e.stp)
    results["summary"] = summarize(results)
    return results


def check_prompt_lengths(
    models: dict[str, MtpcModel],
    prompt_sets: list[list[Any]],
    encoded: list[list[torch.Tensor]],
    names: list[Any],
    max_new_tokens: int,
) -> None:
    """ValueError naming the first prompt (set, index, and its file:line when it is a `Prompt`) whose
    ids + max_new_tokens + the largest window exceed a backbone's context: what generation needs per
    prompt, found before anything decodes."""
    window = max(m.window for m in models.values())
    context = min(m.backbone.max_context for m in models.values())
    for name, texts, ids in zip(names, prompt_sets, encoded, strict=True):
        for i, (text, p) in enumerate(zip(texts, ids, strict=True)):
            need = p.shape[0] + max_new_tokens + window
            if need > context:
                where = f" ({text.where})" if getattr(text, "where", None) else ""
                raise ValueError(
                    f"prompt {i} of set {name}{where}: {p.shape[0]} ids (the prompt as the model reads it) "
                    f"+ eval.max_new_tokens {max_new_tokens} + window {window} = {need} exceeds the "
                    f"backbone's context of {context} positions; expected a shorter prompt or max_new_tokens"
                )


def _evaluate_at(
    models: dict[str, MtpcModel],
    encoded: list[list[torch.Tensor]],
    names: list[Any],
    e: EvalConfig,
    modes: tuple[str, ...],
    temperature: float,
    *,
    ff_name: str | None,
    progress: bool,
    evabyte_mtp: bool,
    continuation_batch: int,
    should_stop: Callable[[], bool] | None,
) -> dict[str, Any]:
    """`evaluate_heads` at one temperature (its modes at it): every job, timed then offline; no summary."""
    first = next(iter(models.values()))
    max_new_tokens, top_p, seed, eos = e.max_new_tokens, e.top_p, e.seed, e.eos
    extra_tokens, acceptance, latency_prompts, stp = (e.extra_token,), e.acceptance, e.latency_prompts, e.stp
    offline = acceptance == "offline"
    kw = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    jobs = [
        EvalJob(mode, eos_mode, name, ps)
        for mode in modes
        for eos_mode in eos
        for name, ps in zip(names, encoded, strict=True)
    ]
    # what the loop times: every prompt online; offline the first `latency_prompts` of each set
    timed_jobs = [
        EvalJob(j.mode, j.eos, j.set_name, j.prompts[:latency_prompts]) if offline else j for j in jobs
    ]
    heads = [(name, model, extra) for name, model in models.items() for extra in extra_tokens]
    timed: list[
        tuple[Any, list[Any]]
    ] = []  # per job: STP (stats, answers) or None, [(stats, answers) per head]
    with timing(progress):  # nothing else times on this machine meanwhile; the background pre-training paused
        bar = tqdm(
            total=sum(len(j.prompts) for j in timed_jobs) * (int(stp) + len(heads)),
            desc="evaluate",
            disable=not progress,
            file=sys.stderr,
        )
        for job in timed_jobs:
            _check_stop(should_stop)
            runners = ([(first, None)] if stp else []) + [(model, extra) for _name, model, extra in heads]
            got = _generate_interleaved(runners, job, seed, kw, bar)
            timed.append((got[0], got[1:]) if stp else (None, got))
        bar.close()
    untimed: list[tuple[list[list[int]], dict[str, list[Any]]]] = []
    if offline:
        for job in tqdm(jobs, desc="offline acceptance", disable=not progress, file=sys.stderr):
            _check_stop(should_stop)
            # untimed but heavy (decoding every prompt): it holds the timing lock shared, so that another
            # trial's latency is never timed beside it, while other trials train and decode alongside
            with heavy():
                untimed.append(_offline(models, job, seed, kw, continuation_batch, e.continuation_cache))
    stp_rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    runs: list[dict[str, Any]] = []
    for j, (job, tjob) in enumerate(zip(jobs, timed_jobs, strict=True)):
        base_t, head_t = timed[j]
        if offline:
            ys, off = untimed[j]
            texts = [_answer(first, torch.tensor(y, dtype=torch.long)) for y in ys]
            text_stats = degeneracy_metrics(
                texts
            )  # the plain model's text: STP's and (in distribution) every head's
        base = None
        if base_t is not None:
            stats, answers = base_t
            base = _pool(stats, 1, answers)
            if offline:
                base.update(text_stats)
            stp_rows[job.mode].append({
                "prompt_set": job.set_name, "eos": job.eos, "mu_lat": base["mu_lat"], "throughput": base["throughput"],
                "generated": base["generated"], "peak_mem_bytes": base["peak_mem_bytes"], "timed_prompts": len(tjob.prompts),
                **{k: base[k] for k in DEGENERACY_METRICS}, "per_prompt": _per_prompt(tjob.prompts, stats, answers, job.set_name),
            })  # fmt: skip
        for (name, model, extra), (stats, answers) in zip(heads, head_t, strict=True):
            metrics = _pool(stats, model.draft_len, answers)  # the positions a cycle feeds (m <= n)
            run: dict[str, Any] = {"latency_prompts": len(tjob.prompts)} if offline else {}
            if offline:
                pooled = pool_offline(off[name])
                run["latency_per_prompt"] = _per_prompt(tjob.prompts, stats, answers, job.set_name)
                metrics.update(
                    {
                        k: pooled[k]
                        for k in (
                            "mu_acc",
                            "tokens_per_cycle",
                            "cycles",
                            "generated",
                            "per_position_acceptance",
                            "accepted_length_histogram",
                        )
                    }
                )
                metrics.update(text_stats)
                metrics.pop("backbone_calls")  # of the timed subset only: not this run's count
                metrics["derived_throughput"] = pooled["tokens_per_cycle"] / metrics["mu_lat"]
            if base is not None:
                metrics.update(
                    stp_mu_lat=base["mu_lat"],
                    stp_throughput=base["throughput"],
                    speedup_vs_stp=metrics["throughput"] / base["throughput"],
                )
                if offline:
                    metrics["derived_speedup_vs_stp"] = metrics["derived_throughput"] / base["throughput"]
                metrics.update({f"stp_{k}": base[k] for k in DEGENERACY_METRICS})
            per_prompt = (_per_prompt(job.prompts, off[name], texts, job.set_name) if offline
                          else _per_prompt(job.prompts, stats, answers, job.set_name))  # fmt: skip
            runs.append({
                "head": name, **_describe(model), "mode": job.mode, "extra_token": extra, "eos": job.eos,
                "temperature": temperature, "top_p": top_p, "prompt_set": job.set_name, "seed": seed,
                "acceptance_method": acceptance, **run, "metrics": metrics, "per_prompt": per_prompt,
            })  # fmt: skip
    if ff_name is not None:
        at = lambda r: (r["mode"], r["extra_token"], r["eos"], r["prompt_set"])  # noqa: E731
        ref = {at(r): r["metrics"]["throughput"] for r in runs if r["head"] == ff_name}
        for r in runs:
            r["metrics"]["speedup_vs_ff"] = r["metrics"]["throughput"] / ref[at(r)]
    if evabyte_mtp and "greedy" in modes:
        from experiments.evaluation.evabyte_mtp import evabyte_mtp_runs

        own = evabyte_mtp_runs(first, encoded, max_new_tokens, set_names=names, eos=eos, seed=seed)
        runs += [{"acceptance_method": "online", **r} for r in own]  # its own decoding, timed
    results = {
        # where and how it ran: the engine's weight layout changes latencies as much as the CPU does
        "hardware": f"{hardware()}; engine {first.engine_label()}",
        "config": {
            "modes": list(modes), "extra_tokens": list(extra_tokens), "eos": list(eos), "sets": len(encoded),
            "num_prompts": [len(ps) for ps in encoded], "ff_head": ff_name, **kw, "seed": seed,
            "acceptance": acceptance, **({"latency_prompts": latency_prompts} if offline else {}),
        },
        "stp": stp_rows,
        "runs": runs,
    }  # fmt: skip
    return results


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Mean ± std (over prompt sets) of each metric per (head, mode, extra_token, eos, temperature,
    acceptance_method): offline and online figures are never averaged together."""
    groups: dict[tuple, list[dict]] = {}
    for r in results["runs"]:
        key = (
            r["head"],
            r["mode"],
            r["extra_token"],
            r.get("eos", "banned"),
            r.get("temperature"),
            r.get("acceptance_method", "online"),
        )
        groups.setdefault(key, []).append(r)
    out = []
    for (_head, mode, extra, eos, temperature, method), rs in groups.items():
        row = {k: rs[0][k] for k in ("head", "backbone", "circuit", "window", "rank", "lora_depth")}
        row.update(
            {
                "mode": mode,
                "extra_token": extra,
                "eos": eos,
                "temperature": temperature,
                "acceptance_method": method,
                "sets": len(rs),
            }
        )
        for k in EVAL_METRICS:
            vals = [r["metrics"][k] for r in rs if k in r["metrics"]]
            if vals:
                row[k] = {
                    "mean": statistics.fmean(vals),
                    "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                }
        out.append(row)
    return out


def degeneracy_warnings(summary: list[dict[str, Any]]) -> list[str]:
    """One line per summary row whose acceptance comes from degenerate text (mean degenerate_fraction > 0.25)."""
    lines = []
    for row in summary:
        frac = row.get("degenerate_fraction", {}).get("mean")
        if frac is not None and frac == frac and frac > DEGENERATE_WARN_FRACTION:
            lines.append(
                f"warning: {row['head']} {row['circuit']} n={row['window']} {row['mode']}/{row['extra_token']}/eos "
                f"{row['eos']}: degenerate_fraction {frac:.2f} > {DEGENERATE_WARN_FRACTION}: its acceptance is "
                "measured on looping text"
            )
    return lines


# ---------------------------------------------------------------------------------------- MLflow


def log_evaluation_to_mlflow(
    results: dict[str, Any],
    parent_run_id: str,
    params: dict[str, Any] | None = None,
    heads: list[str] | None = None,
    tracking_uri: str | None = None,
) -> list[str]:
    """One evaluation run per (head, mode, extra_token, prompt_set) under `parent_run_id`, written by
    `tracking.log_evaluation` (named e.g. `cp-r8-n16-k0/sample/set1`); returns their ids.

    Each carries the EVAL_PARAMS params (backbone, circuit, window, rank, lora_depth, mode,
    extra_token, eos, temperature, prompt_set, seed, top_p, hardware, acceptance_method; offline
    also latency_prompts) plus `params` (e.g. the trial's config), the scalar metrics,
    `acceptance_pos_<i>` (1-based window position), the histogram as `accepted_length_histogram.json`
    and the per-prompt records as `per_prompt.json` (offline: `per_prompt` the offline records of
    every prompt, `latency_per_prompt` the timed subset's online ones). heads:
    which heads to log (default: all but the ff reference). tracking_uri: by the tracking-URI rule
    (None: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db).
    """
    uri = tracking.resolve_uri(explicit=tracking_uri, explicit_source="--mlflow-tracking-uri").uri
    exp_id = tracking.client(uri).get_run(parent_run_id).info.experiment_id
    ff = results["config"].get("ff_head")
    if heads is None:
        names = {r["head"] for r in results["runs"]}
        heads = sorted(names - {ff}) if names - {ff} else sorted(names)
    ids = []
    for r in results["runs"]:
        if r["head"] not in heads:
            continue
        p = {
            k: results["hardware"]
            if k == "hardware"
            else r.get(k, "online")
            if k == "acceptance_method"
            else r[k]
            for k in EVAL_PARAMS
        }
        p["max_new_tokens"] = results["config"]["max_new_tokens"]
        if "latency_prompts" in r:
            p["latency_prompts"] = r["latency_prompts"]
        for k, v in (params or {}).items():
            p.setdefault(k, v)
        m = r["metrics"]
        scalars = {
            k: v for k, v in m.items() if k not in ("per_position_acceptance", "accepted_length_histogram")
        }
        records = {k: r[k] for k in ("per_prompt", "latency_per_prompt") if r.get(k)}
        extra = {PER_PROMPT_ARTIFACT: records} if records else None
        ids.append(
            tracking.log_evaluation(
                uri,
                parent_run_id,
                p,
                scalars,
                per_position_acceptance=m["per_position_acceptance"],
                histogram=m["accepted_length_histogram"],
                artifacts=extra,
                experiment_id=exp_id,
            )
        )
    return ids
