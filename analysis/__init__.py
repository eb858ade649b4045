"""Analysis of sweeps: MLflow evaluation runs -> tidy pandas DataFrame -> Pareto fronts, paper
figures (acceptance vs latency with iso-throughput lines, throughput vs n / k, per-position
acceptance) and tables. Entry point: `python analysis/pareto.py`. See docs/analysis.md.

Modules: load (MLflow -> DataFrame), front (pure Pareto front), aggregate (mean ± std over
prompt sets), tables, plots, pareto (the CLI). Nothing here is imported by `mtpc/`.
"""
