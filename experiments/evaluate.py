"""Evaluate speculative decoding: STP and MtPC heads (and an ff reference) on the same prompts, in one process.

    python -m experiments.evaluate --head <dir> [--ff-head <dir>] [--prompts heldout|<jsonl>]
        [--num-prompts 16 --sets 1 --max-new-tokens 128] [--mode greedy|sample|both]
        [--eos banned|allowed|both] [--acceptance offline|online --latency-prompts 16]
        --out results.json [--mlflow-parent-run <id>]

The flags' defaults are `experiments.config.EvalConfig`'s, the evaluation settings a sweep spec's
`eval` section and a sweep trial use too.

Importable pieces (the sweep trial calls them): `load_prompt_sets`, `evaluate_heads` (-> a JSON-able
dict), `summarize` (mean ± std over prompt sets) and `log_evaluation_to_mlflow` (one evaluation run
per (head, mode, extra_token, eos, prompt_set) under a parent run, written by
`tracking.log_evaluation`: the `tracking.schema.EVAL_PARAMS` params, the `EVAL_METRICS` metrics, the
per-position acceptance as metrics `acceptance_pos_<i>`, the accepted-length histogram and the
per-prompt records as artifacts).

How acceptance is obtained (`--acceptance`, the run param `acceptance_method`; a run without it is
online): `offline` (default) computes mu_acc, tokens_per_cycle, the per-position acceptance and the
histogram from the plain model's continuation of every prompt, teacher-forced
(mtpc/speculative/offline.py: greedy exact, cycle for cycle; sampling the loop's expectations, floats)
and times only the first `--latency-prompts` prompts of each set through the speculative loop and
STP: mu_lat, max_throughput, `throughput` and speedup_vs_stp are that subset's, measured, and
`derived_throughput` = tokens_per_cycle (offline) / mu_lat (timed) and `derived_speedup_vs_stp` =
derived_throughput / stp_throughput are logged beside them under their own names. Offline is the
keep cycle only: `--extra-token drop` needs `--acceptance online`, which runs every prompt through
the timed loop (as before the offline method existed).

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
`evaluate_heads` holds the machine-wide timing lock (`experiments.background.timing`:
`$MTPC_TIMING_LOCK`, default `<tmp>/mtpc-timing.lock`) from its first timed generation to its last,
with the background pre-training (if any) stopped: sweep workers train in parallel, but one
evaluation (STP and its heads, prompt set by prompt set) times at a time. The offline acceptance
(decoding every prompt of a set) holds the same lock shared per set (`experiments.background.heavy`),
so it never runs beside another evaluation's timed phase either, while other workers keep training
and decoding beside it.

Leaves out: training (experiments/train.py) and plots (analysis/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import tracking
from experiments.background import heavy, timing
from experiments.config import EvalConfig
from mtpc import MtpcModel
from mtpc.atomic import check_writable, write_json
from mtpc.backbones.common import Backbone
from mtpc.names import DECODE_MODES, EXTRA_TOKEN_OPTIONS
from mtpc.speculative.offline import CONTINUATION_BATCH, pool_offline
from mtpc.textstats import degeneracy_metrics, degenerate
from tracking.runs import machine, machine_line
from tracking.schema import (
    ACCEPTANCE_METHODS,
    DEGENERACY_METRICS,
    DEGENERATE_WARN_FRACTION,
    EOS_MODES,
    EVAL_METRICS,
    EVAL_PARAMS,
    PER_PROMPT_ARTIFACT,
)

SUMMARY_METRICS = EVAL_METRICS


def hardware() -> str:
    """A one-line description of where this ran (`tracking.runs.machine_line`)."""
    return machine_line(machine())


# --------------------------------------------------------------------------------------- prompts


def _read_prompt_file(path: Path) -> list[str]:
    """A .jsonl file: each line a JSON string, {"prompt": str}, or a messages record (first user turn)."""
    prompts = []
    for i, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
        if isinstance(rec, str):
            prompts.append(rec)
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            prompts.append(rec["prompt"])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            users = [m.get("content") for m in rec["messages"] if isinstance(m, dict) and m.get("role") == "user"]
            if not users or not isinstance(users[0], str):
                raise ValueError(f"{path}:{i}: messages record without a user turn")
            prompts.append(users[0])
        else:
            raise ValueError(f"{path}:{i}: expected a JSON string, {{'prompt': str}} or {{'messages': [...]}}")
    return prompts


def load_prompt_sets(source: str = EvalConfig.prompts, num_prompts: int = EvalConfig.n_prompts, sets: int = EvalConfig.sets,
                     seed: int = EvalConfig.seed, *, dev_sets: int = 0, dev_num_prompts: int | None = None) -> list[list[str]]:  # fmt: skip
    """`sets` disjoint sets of `num_prompts` prompts drawn (seeded) from the held-out ShareGPT prompts or
    a .jsonl, then `dev_sets` development sets of `dev_num_prompts` (default `num_prompts`), disjoint
    from them and from each other (`draw_prompt_sets`)."""
    if num_prompts < 1 or sets < 1:
        raise ValueError(f"num_prompts and sets must be >= 1, got {num_prompts} and {sets}")
    if source == "heldout":
        from mtpc.data import sharegpt_corpus

        pool = list(sharegpt_corpus(progress=False).heldout_prompts)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"--prompts: {source!r} is neither 'heldout' nor an existing .jsonl file")
        pool = _read_prompt_file(path)
    return draw_prompt_sets(pool, source, num_prompts, sets, seed, dev_sets=dev_sets, dev_num_prompts=dev_num_prompts)


def draw_prompt_sets(pool: list[str], source: str, num_prompts: int, sets: int, seed: int, *, dev_sets: int = 0,
                     dev_num_prompts: int | None = None) -> list[list[str]]:  # fmt: skip
    """The seeded draw of `load_prompt_sets` from a pool of prompts (`source` names it in errors): the
    pool shuffled with `seed`, cut into `sets` consecutive slices of `num_prompts`, then `dev_sets`
    slices of `dev_num_prompts` after them. With dev_num_prompts = num_prompts (the default) this is
    the draw of sets + dev_sets equal sets: a study that only resizes its dev sets keeps its reported prompts."""
    if num_prompts < 1 or sets < 1 or dev_sets < 0 or (dev_num_prompts is not None and dev_num_prompts < 1):
        raise ValueError(f"num_prompts and sets must be >= 1, dev_sets >= 0 and dev_num_prompts >= 1; got "
                         f"{num_prompts}, {sets}, {dev_sets}, {dev_num_prompts}")  # fmt: skip
    dev_n = num_prompts if dev_num_prompts is None else dev_num_prompts
    sizes = [num_prompts] * sets + [dev_n] * dev_sets
    need = sum(sizes)
    if len(pool) < need:
        what = "sets x num_prompts" if not dev_sets else "sets x num_prompts + dev_sets x dev_num_prompts"
        raise ValueError(f"--prompts {source}: {len(pool)} prompts, but {what} = {need} are needed")
    pool = list(pool)
    random.Random(seed).shuffle(pool)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [pool[a : a + n] for a, n in zip(starts, sizes, strict=True)]


def longest_prompt(e: EvalConfig) -> tuple[int, str]:
    """(ids, what was counted) of the longest prompt evaluation `e` draws, as the suite's byte
    tokenizer renders it (a one-turn chat), without building anything: a prompt file is read and
    drawn; the held-out prompts are read when the corpus is already built; otherwise the shortest a
    held-out prompt may be (mtpc.data.PROMPT_CHARS) is counted, a lower bound."""
    from mtpc.data import CORPUS_VERSION, PROMPT_CHARS
    from mtpc.paths import cache_dir
    from mtpc.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    if e.prompts == "heldout":
        built = cache_dir() / "data" / CORPUS_VERSION / "heldout_prompts.json"
        if not built.is_file():
            return len(tok.render_prompt("x" * PROMPT_CHARS[0])), "the shortest held-out prompt (the corpus is not built yet)"
        pool = json.loads(built.read_text(encoding="utf-8"))
    else:
        path = Path(e.prompts)
        if not path.is_file():
            raise ValueError(f"eval.prompts: {e.prompts!r} is neither 'heldout' nor an existing .jsonl file")
        pool = _read_prompt_file(path)
    drawn = [p for ps in draw_prompt_sets(pool, e.prompts, e.n_prompts, e.sets, e.seed, dev_sets=e.dev_sets,
                                           dev_num_prompts=e.dev_n_prompts) for p in ps]  # fmt: skip
    return max(len(tok.render_prompt(p)) for p in drawn), "the longest drawn prompt"


# -------------------------------------------------------------------------------------- evaluate


def _answer(model: MtpcModel, ids: torch.Tensor) -> bytes | list[int]:
    """The generated answer as bytes (special ids dropped) when the backbone has a tokenizer, else its ids."""
    tok = model.tokenizer
    return tok.decode(ids.tolist()) if tok is not None else ids.tolist()


def _per_prompt(prompts: list[torch.Tensor], stats_list: list[Any], answers: list[bytes | list[int]],
                set_idx: int) -> list[dict[str, Any]]:
    """One record per prompt (same order in every run of a set, so runs pair up prompt by prompt);
    `prompt_sha` (of the prompt's ids) lets a reader check that two runs saw the same prompt.
    `accepted` is the accepted drafts summed over the prompt's cycles: a count online, an expectation
    (a float, kept unrounded) offline under sampling, where `cycles` is one too and `decode_s` None
    (nothing was timed)."""
    out = []
    for i, (p, s, a) in enumerate(zip(prompts, stats_list, answers, strict=True)):
        sha = hashlib.sha1(",".join(map(str, p.tolist())).encode()).hexdigest()[:12]
        accepted = s.accepted if hasattr(s, "accepted") else int(round(s.mu_acc * s.cycles))  # online: a count
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
    hist = [sum(s.accepted_length_histogram[i] for s in stats_list if s.accepted_length_histogram) for i in range(hist_len)]
    mu_lat = decode_s / cycles if cycles else float("nan")
    return {
        "mu_lat": mu_lat,
        "mu_acc": sum(s.mu_acc * s.cycles for s in stats_list) / cycles if cycles else float("nan"),
        "tokens_per_cycle": sum(s.tokens_per_cycle * s.cycles for s in stats_list) / cycles if cycles else float("nan"),
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


def _generate_one(model: MtpcModel, job: EvalJob, i: int, extra_token: str | None, seed: int, kw: dict[str, Any]) -> Any:
    """Prompt i of the job through `model` (speculative with `extra_token`; None: the plain model),
    sampled with seed + i."""
    ban = job.eos == "banned"
    p = job.prompts[i]
    if extra_token is None:
        return model.generate_plain(p, mode=job.mode, seed=seed + i, ban_eos=ban, **kw)
    return model.generate(p, mode=job.mode, seed=seed + i, extra_token=extra_token, ban_eos=ban, **kw)


def _generate_interleaved(runners: list[tuple[MtpcModel, str | None]], job: EvalJob, seed: int, kw: dict[str, Any],
                          bar: Any) -> list[tuple[list[Any], list[bytes | list[int]]]]:
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


PASS_MEMO_ENV = "MTPC_PASS_MEMO_MB"
"""Megabytes of k = 0 passes kept in the process for later evaluations on the same texts (default 2048; 0: off)."""
_PASS_MEMO: OrderedDict[str, Any] = OrderedDict()


def _fused_pass(bb: Backbone, prompts: list[torch.Tensor], cfg: Any, seeds: list[int], batch: int, cache: bool) -> Any:
    """`decode_and_force`, remembered in this process under the continuation cache's key (the texts and
    the pass of a k = 0 head depend on the verifier, prompts, config, seeds and batch, not on the head):
    a sweep worker evaluating trial after trial on the same prompt sets decodes each once. Least
    recently used passes are dropped beyond `$MTPC_PASS_MEMO_MB`; `cache` False (the continuation
    cache off: weights the key may not tell apart) computes afresh."""
    import os

    from mtpc.speculative.continuation_cache import continuation_key
    from mtpc.speculative.offline import decode_and_force

    try:
        limit = int(float(os.environ.get(PASS_MEMO_ENV, "2048")) * 2**20)
    except ValueError:
        raise ValueError(f"${PASS_MEMO_ENV}={os.environ[PASS_MEMO_ENV]!r}: expected megabytes, e.g. 2048 (0: off)") from None
    if not cache or limit <= 0:
        return decode_and_force(bb, prompts, cfg, seeds=seeds, batch_size=batch)
    key = continuation_key(bb, prompts, cfg, seeds, batch)[0]
    if key in _PASS_MEMO:
        _PASS_MEMO.move_to_end(key)
        return _PASS_MEMO[key]
    tf = decode_and_force(bb, prompts, cfg, seeds=seeds, batch_size=batch)
    _PASS_MEMO[key] = tf

    def size(t: Any) -> int:
        return sum(h.numel() * h.element_size() for h in t.hidden)

    while _PASS_MEMO and sum(size(t) for t in _PASS_MEMO.values()) > limit:
        _PASS_MEMO.popitem(last=False)
    return tf


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise EvaluationStopped("stopped on request between two prompt sets")


def _offline(models: dict[str, MtpcModel], job: EvalJob, seed: int, kw: dict[str, Any], batch: int,
             cache: bool = True) -> tuple[list[list[int]], dict[str, list[Any]]]:  # fmt: skip
    """The plain model's continuations of the job's prompts (prompt i seeded seed + i, as STP) and, per
    head, its offline keep-cycle counts on them: one teacher-forced pass per backbone (heads with
    lora_depth 0 share one), reused by every head on it (mtpc/speculative/offline.py). On the compact
    forward with k = 0 the batched decoding yields that pass as it goes (`decode_and_force`, kept in
    the process for the next evaluation on the same texts: `_fused_pass`; its bytes are stored in the
    cache for LoRA heads); otherwise the continuations come from the on-disk cache
    when another evaluation computed them already (mtpc/speculative/continuation_cache.py; `cache`
    False: computed here, nothing stored)."""
    from mtpc.speculative.continuation_cache import cached_continuations
    from mtpc.speculative.offline import fused_pass_applies, offline_acceptance, teacher_force

    first = next(iter(models.values()))
    cfg = _decode_config(first, job, kw)
    bb = first.backbone
    batch = batch if getattr(bb, "engine", "hf") == "compact" else 1  # batched decoding needs the compact forward
    seeds = [seed + i for i in range(len(job.prompts))]
    passes: dict[int, Any] = {}
    if fused_pass_applies(bb, batch):  # k = 0: decoding yields the pass too; cheaper than a cache hit's pass
        fused = _fused_pass(bb, job.prompts, cfg, seeds, batch, cache)
        passes[id(bb)] = fused
        cached_continuations(bb, job.prompts, cfg, seeds=seeds, batch_size=batch, cache=cache,
                             compute=lambda: fused.continuations)  # fmt: skip  # stored for other evaluations' LoRA heads
        ys = fused.continuations
    else:
        ys = cached_continuations(bb, job.prompts, cfg, seeds=seeds, batch_size=batch, cache=cache)
    out = {}
    for name, model in models.items():
        key = id(model.backbone)
        if key not in passes:
            passes[key] = teacher_force(model.backbone, job.prompts, ys, _decode_config(model, job, kw))
        out[name] = offline_acceptance(passes[key], model.head)
    return ys, out


class EvaluationStopped(Exception):
    """`evaluate_heads` saw its `should_stop` turn true between two prompt sets (a sweep worker asked to
    stop): nothing was returned or logged; the evaluation runs again from the start."""


def evaluate_heads(
    models: dict[str, MtpcModel] | MtpcModel,
    prompt_sets: list[list[str | bytes | torch.Tensor]],
    modes: tuple[str, ...] = ("greedy",),
    extra_tokens: tuple[str, ...] = ("keep",),
    *,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos: tuple[str, ...] = ("banned",),
    ff_name: str | None = None,
    progress: bool = True,
    set_names: list[str] | None = None,
    stp: bool = True,
    evabyte_mtp: bool = False,
    acceptance: str = "online",
    latency_prompts: int = EvalConfig.latency_prompts,
    continuation_batch: int = CONTINUATION_BATCH,
    continuation_cache: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run STP and every head on every prompt set in this process; returns a JSON-able dict.

    models: name -> MtpcModel (they may share a backbone), or one MtpcModel (named "head");
    STP runs on the first one's backbone.
    ff_name: the key of an ff head in `models`; every other run then gets `speedup_vs_ff`.
    eos: EOS treatments to run, each of "banned" / "allowed" (every (mode, eos) pair is evaluated).
    set_names: the `prompt_set` value of each set (default 0, 1, ...; "dev0" marks development prompts).
    stp: run the plain model beside the heads (default); False skips it (about half the time of an
    evaluation) and leaves out every stp_* metric and speedup_vs_stp.
    evabyte_mtp: also run the backbone's own multi-byte decoding, greedy (experiments/evabyte_mtp.py).
    acceptance: "online" (default here; the CLI's and a sweep's default is EvalConfig's "offline"):
    every prompt through the timed speculative loop. "offline": mu_acc, tokens_per_cycle, the
    per-position acceptance and the histogram come from the plain model's continuation of every
    prompt, teacher-forced (exact cycles when greedy, expectations when sampling; extra_token keep
    only); only the first `latency_prompts` prompts of each set go through the timed loop (and STP),
    which gives mu_lat, max_throughput, the measured `throughput` and speedup_vs_stp of that subset;
    `derived_throughput` = tokens_per_cycle (offline) / mu_lat (timed) and `derived_speedup_vs_stp`
    = derived_throughput / stp_throughput. The degeneracy metrics read the continuations.
    continuation_batch: offline, at most this many prompts decoded at once for the continuations (compact
        Llama forward; batches of similar length, in groups of similar length on the CPU, also capped at
        `offline.KV_BUDGET_BYTES` of keys and values; default `offline.CONTINUATION_BATCH`).
    continuation_cache: offline, read and store the continuations in the on-disk cache shared by every
    evaluation and process (mtpc/speculative/continuation_cache.py; keyed by the backbone's weights,
    the decode config, the prompts and seeds); False computes them here and stores nothing.
    should_stop: checked before every prompt set's timed and offline part; when it turns true,
    EvaluationStopped is raised (an evaluation of hundreds of prompts per set takes many minutes, longer
    than a cluster's pre-emption notice).
    Prompt i of a set is sampled with seed + i for STP and every head alike.
    Everything timed runs under `experiments.background.timing`: one timer on the machine at a time;
    STP and the heads run each prompt in turn (interleaved rounds, after a short warm-up call each). The
    offline computation runs after it, untimed, and waits while another process times.
    The evaluation is a list of `EvalJob`s, one per (mode, eos, prompt set) in that order; each runs
    STP (when `stp`) and then every (head, extra_token).
    """
    if isinstance(models, MtpcModel):
        models = {"head": models}
    if not models:
        raise ValueError("models: need at least one head")
    if isinstance(eos, str):
        eos = (eos,)
    bad = ([m for m in modes if m not in DECODE_MODES] + [e for e in extra_tokens if e not in EXTRA_TOKEN_OPTIONS]
           + [e for e in eos if e not in EOS_MODES])
    if bad:
        raise ValueError(f"modes must be in {DECODE_MODES}, extra_tokens in {EXTRA_TOKEN_OPTIONS} and eos in "
                         f"{EOS_MODES}; got {bad}")
    if acceptance not in ACCEPTANCE_METHODS:
        raise ValueError(f"acceptance: {acceptance!r} is not one of {list(ACCEPTANCE_METHODS)}")
    offline = acceptance == "offline"
    if offline and set(extra_tokens) != {"keep"}:
        raise ValueError(f"extra_token {[e for e in extra_tokens if e != 'keep']}: offline acceptance mirrors the keep "
                         "cycle only (drop is not exact); expected keep, or acceptance online")  # fmt: skip
    if latency_prompts < 1:
        raise ValueError(f"latency_prompts: expected an integer >= 1, got {latency_prompts}")
    if ff_name is not None and ff_name not in models:
        raise ValueError(f"ff_name={ff_name!r} is not one of the models {sorted(models)}")
    if set_names is not None and len(set_names) != len(prompt_sets):
        raise ValueError(f"set_names: {len(set_names)} names for {len(prompt_sets)} prompt sets")
    first = next(iter(models.values()))
    kw = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    encoded = [[first.encode_prompt(p) for p in ps] for ps in prompt_sets]
    names = list(set_names or range(len(prompt_sets)))
    jobs = [EvalJob(mode, eos_mode, name, ps) for mode in modes for eos_mode in eos
            for name, ps in zip(names, encoded, strict=True)]
    # what the loop times: every prompt online; offline the first `latency_prompts` of each set
    timed_jobs = [EvalJob(j.mode, j.eos, j.set_name, j.prompts[:latency_prompts]) if offline else j for j in jobs]
    heads = [(name, model, extra) for name, model in models.items() for extra in extra_tokens]
    timed: list[tuple[Any, list[Any]]] = []  # per job: STP (stats, answers) or None, [(stats, answers) per head]
    with timing(progress):  # nothing else times on this machine meanwhile; the background pre-training paused
        bar = tqdm(total=sum(len(j.prompts) for j in timed_jobs) * (int(stp) + len(heads)), desc="evaluate",
                   disable=not progress, file=sys.stderr)
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
                untimed.append(_offline(models, job, seed, kw, continuation_batch, continuation_cache))
    stp_rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    runs: list[dict[str, Any]] = []
    for j, (job, tjob) in enumerate(zip(jobs, timed_jobs, strict=True)):
        base_t, head_t = timed[j]
        if offline:
            ys, off = untimed[j]
            texts = [_answer(first, torch.tensor(y, dtype=torch.long)) for y in ys]
            text_stats = degeneracy_metrics(texts)  # the plain model's text: STP's and (in distribution) every head's
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
            metrics = _pool(stats, model.window, answers)
            run: dict[str, Any] = {"latency_prompts": len(tjob.prompts)} if offline else {}
            if offline:
                pooled = pool_offline(off[name])
                run["latency_per_prompt"] = _per_prompt(tjob.prompts, stats, answers, job.set_name)
                metrics.update({k: pooled[k] for k in ("mu_acc", "tokens_per_cycle", "cycles", "generated",
                                                       "per_position_acceptance", "accepted_length_histogram")})
                metrics.update(text_stats)
                metrics.pop("backbone_calls")  # of the timed subset only: not this run's count
                metrics["derived_throughput"] = pooled["tokens_per_cycle"] / metrics["mu_lat"]
            if base is not None:
                metrics.update(stp_mu_lat=base["mu_lat"], stp_throughput=base["throughput"],
                               speedup_vs_stp=metrics["throughput"] / base["throughput"])
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
        from experiments.evabyte_mtp import evabyte_mtp_runs

        own = evabyte_mtp_runs(first, encoded, max_new_tokens, set_names=set_names, eos=eos, seed=seed)
        runs += [{"acceptance_method": "online", **r} for r in own]  # its own decoding, timed
    results = {
        # where and how it ran: the engine's weight layout changes latencies as much as the CPU does
        "hardware": f"{hardware()}; engine {first.engine_label()}",
        "config": {
            "modes": list(modes), "extra_tokens": list(extra_tokens), "eos": list(eos), "sets": len(prompt_sets),
            "num_prompts": [len(ps) for ps in prompt_sets], "ff_head": ff_name, **kw, "seed": seed,
            "acceptance": acceptance, **({"latency_prompts": latency_prompts} if offline else {}),
        },
        "stp": stp_rows,
        "runs": runs,
    }  # fmt: skip
    results["summary"] = summarize(results)
    return results


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Mean ± std (over prompt sets) of each metric per (head, mode, extra_token, eos, temperature,
    acceptance_method): offline and online figures are never averaged together."""
    groups: dict[tuple, list[dict]] = {}
    for r in results["runs"]:
        key = (r["head"], r["mode"], r["extra_token"], r.get("eos", "banned"), r.get("temperature"),
               r.get("acceptance_method", "online"))
        groups.setdefault(key, []).append(r)
    out = []
    for (_head, mode, extra, eos, temperature, method), rs in groups.items():
        row = {k: rs[0][k] for k in ("head", "backbone", "circuit", "window", "rank", "lora_depth")}
        row.update({"mode": mode, "extra_token": extra, "eos": eos, "temperature": temperature,
                    "acceptance_method": method, "sets": len(rs)})
        for k in SUMMARY_METRICS:
            vals = [r["metrics"][k] for r in rs if k in r["metrics"]]
            if vals:
                row[k] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0}
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
        p = {k: results["hardware"] if k == "hardware" else r.get(k, "online") if k == "acceptance_method" else r[k]
             for k in EVAL_PARAMS}
        p["max_new_tokens"] = results["config"]["max_new_tokens"]
        if "latency_prompts" in r:
            p["latency_prompts"] = r["latency_prompts"]
        for k, v in (params or {}).items():
            p.setdefault(k, v)
        m = r["metrics"]
        scalars = {k: v for k, v in m.items() if k not in ("per_position_acceptance", "accepted_length_histogram")}
        records = {k: r[k] for k in ("per_prompt", "latency_per_prompt") if r.get(k)}
        extra = {PER_PROMPT_ARTIFACT: records} if records else None
        ids.append(tracking.log_evaluation(
            uri, parent_run_id, p, scalars, per_position_acceptance=m["per_position_acceptance"],
            histogram=m["accepted_length_histogram"], artifacts=extra, experiment_id=exp_id,
        ))
    return ids


# ------------------------------------------------------------------------------------------- CLI


def _choices(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    items = tuple(allowed) if value == "both" else tuple(v.strip() for v in value.split(","))
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"{flag}: {bad} not in {allowed} (or 'both', or a comma list)")
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="head export directory (save_head)")
    ap.add_argument("--ff-head", default=None, help="an ff head export evaluated alongside (speedup_vs_ff)")
    ap.add_argument("--backbone", default=None, help="override the backbone recorded in the head")
    d = EvalConfig()
    ap.add_argument("--prompts", default=d.prompts, help="'heldout' (ShareGPT held-out prompts) or a .jsonl file")
    ap.add_argument("--num-prompts", type=int, default=d.n_prompts)
    ap.add_argument("--sets", type=int, default=d.sets)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--mode", default=",".join(d.modes), help="greedy, sample, both, or a comma list (default: both)")
    ap.add_argument("--extra-token", default=d.extra_token, help="keep, drop, both, or a comma list")
    ap.add_argument("--temperature", type=float, default=d.temperatures[0])
    ap.add_argument("--top-p", type=float, default=d.top_p)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--acceptance", default=d.acceptance, choices=ACCEPTANCE_METHODS,
                    help="offline (default: acceptance teacher-forced on the plain model's continuations of every "
                         "prompt, mu_lat timed on --latency-prompts) or online (every prompt through the timed loop)")
    ap.add_argument("--latency-prompts", type=int, default=d.latency_prompts,
                    help="offline: prompts per set timed through the online loop and STP (the first ones)")
    ap.add_argument("--no-continuation-cache", action="store_true", default=not d.continuation_cache,
                    help="offline: compute the plain model's continuations here instead of reading / storing them in "
                         "the cache shared by every evaluation ($MTPC_CONTINUATION_CACHE_DIR, else <mtpc cache>/continuations)")
    ap.add_argument("--eos", default=",".join(d.eos),
                    help="banned (default: EOS gets probability 0, equal lengths), allowed (EOS stops), or both")
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: where the backbone loads)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="let the backbone's checkpoint run its own modelling code (a hub id also needs --revision)")
    ap.add_argument("--revision", default=None, help="the hub commit hash of the backbone to load")
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--mlflow-parent-run", default=None, help="log one child run per (mode, prompt_set) under it")
    ap.add_argument("--mlflow-tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1 is steadier on a shared CPU)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--evabyte-mtp", action="store_true",
                    help="also run EvaByte's own multi-byte decoding (greedy, truncated to the budget) as a baseline")
    args = ap.parse_args(argv)
    from experiments.quiet import quiet

    quiet()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        modes = _choices(args.mode, DECODE_MODES, "--mode")
        extras = _choices(args.extra_token, EXTRA_TOKEN_OPTIONS, "--extra-token")
        eos = _choices(args.eos, EOS_MODES, "--eos")
        if args.acceptance == "offline" and "drop" in extras:
            raise ValueError("--extra-token drop: online-only (offline acceptance mirrors the keep cycle; drop is not "
                             "exact); expected keep, or --acceptance online")
        check_writable(args.out, "--out")  # before anything decodes: the results must have a place to go
        for flag in ("head", "ff_head"):
            d = getattr(args, flag)
            if d is not None and not Path(d).expanduser().is_dir():
                raise ValueError(f"--{flag.replace('_', '-')}: {d!r} does not exist or is not a directory")
            if d is not None and not (Path(d).expanduser() / "config.json").is_file():
                raise ValueError(f"--{flag.replace('_', '-')}: {d!r} is not a head export (no config.json)")
        prompt_sets = load_prompt_sets(args.prompts, args.num_prompts, args.sets, args.seed)
        load_kw = {"device": args.device} if args.device else {}
        if args.trust_remote_code or args.revision:
            load_kw.update(trust_remote_code=args.trust_remote_code, revision=args.revision)
        main_model = MtpcModel.from_pretrained(args.head, backbone=args.backbone, **load_kw)
        models = {"head": main_model}
        if args.ff_head:
            ff = _load_sharing_backbone(args.ff_head, main_model)
            if ff.head.config.kind != "ff":
                raise ValueError(f"--ff-head: {args.ff_head} holds a {ff.head.config.kind} head, not ff")
            models["ff"] = ff
        results = evaluate_heads(
            models, prompt_sets, modes, extras, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, seed=args.seed, eos=eos, ff_name="ff" if args.ff_head else None,
            progress=not args.no_progress, evabyte_mtp=args.evabyte_mtp, acceptance=args.acceptance,
            latency_prompts=args.latency_prompts, continuation_cache=not args.no_continuation_cache,
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results["config"].update({"head_dir": str(args.head), "ff_head_dir": args.ff_head, "prompts": args.prompts})
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results, indent=2)
    for row in results["summary"]:
        m = {k: f"{row[k]['mean']:.4g}±{row[k]['std']:.2g}"
             for k in ("mu_acc", "tokens_per_cycle", "speedup_vs_stp", "derived_speedup_vs_stp", *DEGENERACY_METRICS)
             if k in row}
        print(f"{row['head']:>5} {row['circuit']:>5} n={row['window']} {row['mode']}/{row['extra_token']}/eos {row['eos']} "
              f"({row['acceptance_method']}): {m}")
    for line in degeneracy_warnings(results["summary"]):
        print(line, file=sys.stderr)
    if args.mlflow_parent_run:
        ids = log_evaluation_to_mlflow(results, args.mlflow_parent_run, tracking_uri=args.mlflow_tracking_uri)
        print(f"logged {len(ids)} child runs under {args.mlflow_parent_run}")
    print(f"wrote {out}")
    return 0


def _load_sharing_backbone(head_dir: str, main: MtpcModel) -> MtpcModel:
    """Load a second head on the main model's backbone weights (a new adapter if its lora_depth differs)."""
    from mtpc.heads import load_head

    head, _ = load_head(head_dir)
    bb = main.backbone
    if head.config.lora_depth == bb.lora_depth and head.config.lora_depth == 0:
        return MtpcModel.from_pretrained(head_dir, backbone=bb)
    m = MtpcModel.from_pretrained(head_dir, backbone=bb.model)
    m.backbone.tokenizer = bb.tokenizer
    return m


if __name__ == "__main__":
    raise SystemExit(main())
