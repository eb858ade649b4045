"""Analysis of sweeps: MLflow evaluation runs -> tidy pandas DataFrame -> Pareto fronts, paper
figures (acceptance vs latency with iso-throughput lines, throughput vs n / k, per-position
acceptance) and tables. Entry point: `python -m analysis` (analysis/__main__.py). See docs/analysis.md.

Modules: load (MLflow -> DataFrame, through tracking/), filters, hists (histogram artifacts),
front (pure Pareto front), aggregate (mean ± std over prompt sets), tables, style (the look,
`save`), pareto_plot (the Pareto figure), plots (the other figures). Nothing here is imported by
`mtpc/`, experiments/ or sweeps/.
"""

import os as _os
import sys as _sys

# No import from the current directory (docs/reliability.md, "No code without consent"): `python -m`
# puts it first on sys.path, where a planted `torch.py` or `yaml.py` would shadow the real module.
# Dropped before anything is imported, unless it is the checkout this package runs from.
_here = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
_cwd = _os.path.realpath(_os.getcwd())
if _cwd != _here:
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _cwd]
del _os, _sys, _here, _cwd
