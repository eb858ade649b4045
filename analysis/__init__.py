"""Analysis of sweeps: MLflow evaluation runs -> tidy pandas DataFrame -> Pareto fronts, paper
figures (acceptance vs latency with iso-throughput lines, throughput vs n / k, per-position
acceptance) and tables. Entry point: `python -m analysis` (analysis/__main__.py). See docs/analysis.md.

Modules: load (MLflow -> DataFrame, through tracking/), filters, hists (histogram artifacts),
front (pure Pareto front), aggregate (mean ± std over prompt sets), tables, style (the look,
`save`), pareto_plot (the Pareto figure), plots (the other figures). Nothing here is imported by
`mtpc/`, experiments/ or sweeps/.
"""
