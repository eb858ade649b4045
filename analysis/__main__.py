"""`python -m analysis`: figures and paper-style tables of a sweep, read from MLflow.

Per setting (backbone, mode, extra_token, eos, temperature[, top_p, hardware]) it writes to --out,
<setting> being the mode and whatever else differs between the settings (`greedy`, `sample_T0.7`):
  pareto_<setting>.png/.pdf            mu_acc vs mu_lat, front, iso-throughput lines, STP, and each
                                       --reference head measured in that setting (a labelled star)
  throughput_vs_window_<setting>.*     when the window varies
  throughput_vs_lora_depth_<setting>.* when the LoRA depth varies
  acceptance_<setting>.*               per-position acceptance (acceptance_pos_<i> metrics), if logged
  accepted_length_<setting>.*          accepted-length histogram artifact, if logged
  table_<setting>.md / .tex            rows (n, r, circuit[, k][, β][, seed]), mean ± std, best in bold,
                                       degenerate_fraction beside them
plus tables.md, tables.tex and summary.csv for all settings, and prints the best configuration
per setting, and a warning per setting whose acceptance comes from degenerate text
(degenerate_fraction > 0.25). When the runs come from one experiment (a sweep), all of it is also
logged as the artifacts of that experiment's sweep-level run `pareto-summary` (`--summary-run-name`;
a later analysis replaces it: the earlier one is deleted); `--no-log-to-mlflow` writes files only,
`--log-to-mlflow` makes a second experiment an error instead of a note; the --reference files drawn
go to that run too (artifacts under `references/`).

`--reference FILE` (repeatable): a head measured outside the sweep by the sweep's own evaluation
function (analysis/reference.py; the demo writes its shipped default head's as
`<out>/shipped_head.json`), drawn in the Pareto figure of each setting it was measured in, on the
same prompt sets; never on the front, in a table or in summary.csv. A reference that matches no
setting gets a note saying where it was measured; an unreadable one is an error (exit 1).

The files are written as a set: into `<out>.tmp<pid>` beside --out, then renamed into --out once
all are complete, so a full disk leaves the previous outputs as they were (one line naming the file
and "no space left", exit 1). Evaluation runs of deleted trial runs are left out (a note counts
them); an evaluation stored under several finished trial runs of one grid point is taken from the
newest only (a warning names the point: analysis/load.py).

Errors (no match, unreachable store, ...) print one clear message and exit 1; runs missing a
metric are listed and skipped. (A package entry point: run as a module, the package directory is
not put on sys.path, so no module here can shadow an installed one such as PyPI's `tables`.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import tracking
from analysis.aggregate import aggregate, short_slugs, split_settings
from analysis.filters import Filters
from analysis.hists import load_hists
from analysis.load import AnalysisError, LoadResult, load
from analysis.reference import points_for, read_reference, reference_points, unmatched_note
from mtpc.names import CIRCUIT_KINDS, DECODE_MODES, EXTRA_TOKEN_OPTIONS
from tracking.schema import BASELINE_METHODS

DEFAULT_OUT = "outputs/analysis"
MAX_LISTED_SKIPS = 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis",
        description="Pareto plots (acceptance vs latency, iso-throughput lines) and paper tables from MLflow runs.",
    )
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db)",
    )
    p.add_argument(
        "--experiment",
        help="experiment name or id (default: $MLFLOW_EXPERIMENT_NAME, else every experiment with runs)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--mode", nargs="+", choices=DECODE_MODES, help="keep only these decoding modes")
    p.add_argument("--backbone", nargs="+", help="keep only these backbones")
    p.add_argument(
        "--extra-token", nargs="+", choices=EXTRA_TOKEN_OPTIONS, help="keep only these extra-token rules"
    )
    p.add_argument("--temperature", nargs="+", type=float, help="keep only these temperatures")
    p.add_argument("--window", nargs="+", type=int, help="keep only these windows n")
    p.add_argument("--lora-depth", nargs="+", type=int, help="keep only these LoRA depths k")
    p.add_argument(
        "--circuit",
        nargs="+",
        choices=(*CIRCUIT_KINDS, *BASELINE_METHODS),
        help="keep only these circuits (or EvaByte's own decoding, evabyte-mtp)",
    )
    p.add_argument(
        "--prompt-sets",
        choices=("reported", "dev", "all"),
        default="reported",
        help="reported prompt sets (default), the development sets dev<i> (used to choose settings), or all",
    )
    p.add_argument(
        "--top", type=int, default=5, help="configurations shown in the acceptance plots (default 5)"
    )
    p.add_argument(
        "--log-to-mlflow",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="attach figures and tables to the sweep-level summary run of the experiment (default: "
        "when the runs come from one experiment)",
    )
    p.add_argument(
        "--reference",
        action="append",
        metavar="FILE",
        help="a reference head's JSON (analysis/reference.py; the demo writes <out>/shipped_head.json), "
        "drawn as a labelled star in the Pareto figures of the settings it was measured in; repeatable",
    )
    p.add_argument(
        "--summary-run-name",
        default="pareto-summary",
        help="name of that summary run (default: pareto-summary)",
    )
    return p


def filters_from_args(args: argparse.Namespace) -> Filters:
    def tup(v):
        return None if v is None else tuple(v)

    return Filters(
        backbone=tup(args.backbone),
        mode=tup(args.mode),
        extra_token=tup(args.extra_token),
        temperature=tup(args.temperature),
        window=tup(args.window),
        lora_depth=tup(args.lora_depth),
        circuit=tup(args.circuit),
        prompt_sets=args.prompt_sets,
    )


def report_skips(result: LoadResult) -> None:
    if result.skipped:
        n = len(result.skipped)
        print(
            f"warning: {n} evaluation run(s) skipped for missing or malformed params/metrics:",
            file=sys.stderr,
        )
        for s in result.skipped[:MAX_LISTED_SKIPS]:
            print(
                f"  {s.run_id} ({s.run_name or 'unnamed'}): missing {', '.join(s.missing)}", file=sys.stderr
            )
        if n > MAX_LISTED_SKIPS:
            print(f"  ... and {n - MAX_LISTED_SKIPS} more", file=sys.stderr)
    if result.n_unfinished:
        print(f"note: {result.unfinished_note()} (status not FINISHED)", file=sys.stderr)
    if result.n_of_deleted:
        print(
            f"note: {result.n_of_deleted} evaluation run(s) of deleted trial runs left out", file=sys.stderr
        )
    for note in result.duplicates:
        print(f"warning: {note}", file=sys.stderr)
    for note in result.missing_points:
        print(f"warning: {note}", file=sys.stderr)


def write_outputs(
    result: LoadResult, client, out: Path, top: int = 5, references: list[tuple] | None = None
) -> tuple[list[Path], list[str]]:
    """Figures, tables and summary for every setting, written as a set: all into a temporary folder
    beside `out` (`<out>.tmp<pid>`), then moved into `out` by renames only once every file is
    complete, so `out` holds either the whole new set or its previous files untouched (a full disk:
    OSError naming the file, "no space left"). `references`: (Reference, its points by setting:
    `analysis.reference.reference_points`) per reference file, drawn in the Pareto figures; one that
    no figure draws gets a note on stderr. Returns (written files, best-config lines)."""
    from mtpc.atomic import disk_error, fsync_dir, remove_stale_temps, temp_name

    dest = out.resolve()  # `--out .` has no name to put a temporary beside; a link: beside its target
    if dest.exists() and not dest.is_dir():
        raise OSError(f"{out}: not a directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest.parent, dest.name)  # of an analysis killed while writing
    tmp = temp_name(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        written, best = _write_set(result, client, tmp, top, references or [])
        dest.mkdir(exist_ok=True)
        for f in written:  # renames within one filesystem: no space needed, nothing half-written
            os.replace(f, dest / f.name)
        fsync_dir(dest)
    except (
        OSError
    ) as e:  # named as the file it was to be, not its temporary; a full disk says "no space left"
        if e.filename:  # a native error (mkdir, rename); mtpc.atomic's already name their file
            e = disk_error(e, e.filename)
        raise OSError(e.errno, (e.strerror or str(e)).replace(str(tmp), str(dest))) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / f.name for f in written], best


def _write_set(
    result: LoadResult, client, out: Path, top: int, references: list[tuple]
) -> tuple[list[Path], list[str]]:
    """Every output file into the (temporary) folder `out`, each flushed to disk (mtpc.atomic)."""
    from analysis import (  # matplotlib import is slow: only when there is work
        paper_tables,
        pareto_plot,
        plots,
        style,
    )
    from mtpc.atomic import write_text

    agg = aggregate(result.runs)
    parts = split_settings(agg)
    written: list[Path] = []
    best_lines: list[str] = []
    hist_problems: list[str] = []
    md_all: list[str] = []
    tex_all: list[str] = []
    drawn = [0] * len(references)  # Pareto figures per reference
    for (setting, part), slug in zip(parts, short_slugs([s for s, _ in parts]), strict=True):
        refs = []
        for i, (_, points) in enumerate(references):
            found = points_for(setting, part, [points])
            drawn[i] += len(found)
            refs += found
        written += style.save(
            pareto_plot.pareto_figure(setting, part, references=refs), out, f"pareto_{slug}"
        )
        for x in ("window", "lora_depth"):
            fig = plots.throughput_figure(setting, part, x=x)
            if fig is not None:
                written += style.save(fig, out, f"throughput_vs_{x}_{slug}")
        # histogram artifacts only of the configurations the plots show (downloads are slow)
        ids = [r for row, _, _ in plots.representatives(part, top) for r in row["run_ids"]]
        hists, problems = load_hists(client, ids) if client is not None else ({}, [])
        hist_problems += problems
        fig = plots.acceptance_figure(setting, part, top=top, hists=hists)
        if fig is not None:
            written += style.save(fig, out, f"acceptance_{slug}")
        fig = plots.accepted_length_figure(setting, part, hists, top=min(top, 4))
        if fig is not None:
            written += style.save(fig, out, f"accepted_length_{slug}")
        table = paper_tables.build_table(setting, part)
        md, tex = paper_tables.to_markdown(table), paper_tables.to_latex(table)
        for suffix, text in (("md", md), ("tex", tex)):
            path = out / f"table_{slug}.{suffix}"
            write_text(path, text)
            written.append(path)
        md_all.append(md)
        tex_all.append(tex)
        best_lines.append(paper_tables.best_configuration(setting, part))
        warning = paper_tables.degeneracy_warning(table)
        if warning:
            print(warning, file=sys.stderr)
    for (ref, points), n in zip(references, drawn, strict=True):
        note = unmatched_note(ref, points, n)
        if note:
            print(note, file=sys.stderr)
    for name, text in (("tables.md", "\n".join(md_all)), ("tables.tex", "\n".join(tex_all))):
        write_text(out / name, text)
        written.append(out / name)
    if hist_problems:  # one line per kind of problem, not one per run
        print(
            f"warning: {len(hist_problems)} accepted-length histogram(s) skipped, e.g. {hist_problems[0]}",
            file=sys.stderr,
        )
    write_text(out / "summary.csv", agg.drop(columns="run_ids").to_csv(index=False))
    written.append(out / "summary.csv")
    return written, best_lines


def single_experiment(result: LoadResult) -> str:
    """The one experiment the runs come from (where the summary run goes), else AnalysisError."""
    exp_ids = sorted(set(result.runs["experiment_id"]))
    if len(exp_ids) != 1:
        raise AnalysisError(
            f"--log-to-mlflow needs one experiment, but the runs come from {len(exp_ids)} "
            f"({', '.join(result.experiments)}); pass --experiment"
        )
    return exp_ids[0]


def log_summary(
    client, result: LoadResult, files: list[Path], args: argparse.Namespace, filters: Filters
) -> str:
    """The sweep-level summary run of the experiment, holding the figures and tables as artifacts;
    an earlier summary run of the same name is deleted (MLflow keeps it in its trash)."""
    exp_id = single_experiment(result)
    flt = f"tags.`{tracking.SUMMARY_TAG}` = 'summary' and attributes.run_name = '{args.summary_run_name}'"
    for old in tracking.iter_runs(client, [exp_id], flt):
        client.delete_run(old.info.run_id)
    run = client.create_run(exp_id, run_name=args.summary_run_name, tags={tracking.SUMMARY_TAG: "summary"})
    run_id = run.info.run_id
    try:
        from mlflow.entities import Param

        params = [Param(f"filter_{k}", ",".join(map(str, v))) for k, v in filters.active().items()]
        params.append(Param("n_evaluation_runs", str(len(result.runs))))
        params.append(Param("n_skipped_runs", str(len(result.skipped))))
        client.log_batch(run_id, params=params)
        for f in files:
            sub = "figures" if f.suffix in (".png", ".pdf") else "tables"
            client.log_artifact(run_id, str(f), artifact_path=sub)
        for ref in args.reference or ():  # what the figures' reference points were read from
            client.log_artifact(run_id, str(ref), artifact_path="references")
    except Exception:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top={args.top}: expected a positive integer")
    try:
        filters = filters_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        refs = [read_reference(p) for p in args.reference or ()]  # a bad file fails before the slow part
        result, client, uri = load(args.tracking_uri, args.experiment, filters)
        report_skips(result)
        log_to_mlflow = args.log_to_mlflow
        if log_to_mlflow:
            single_experiment(result)  # fail before the slow part
        elif log_to_mlflow is None:
            log_to_mlflow = len(set(result.runs["experiment_id"])) == 1
            if not log_to_mlflow:
                print(
                    "note: figures and tables not logged to MLflow: the runs come from several experiments "
                    "(pass --experiment)",
                    file=sys.stderr,
                )
        print(
            f"{len(result.runs)} evaluation run(s) from {', '.join(result.experiments)} at {uri} ({filters.describe()})"
        )
        out = Path(args.out)
        ref_points = [(r, reference_points(r, filters)) for r in refs]
        files, best = write_outputs(result, client, out, top=args.top, references=ref_points)
        for line in best:
            print(line)
        print(f"wrote {len(files)} files to {out}/")
        if log_to_mlflow:
            run_id = log_summary(client, result, files, args, filters)
            print(f"logged figures and tables to MLflow run {run_id} ({args.summary_run_name})")
    except (AnalysisError, tracking.TrackingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"error: cannot write the outputs to {args.out}/: {exc.strerror or exc}; nothing there was replaced",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
