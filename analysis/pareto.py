"""`python analysis/pareto.py [options]`: the suite's documented command for the Pareto plots and
tables; the same CLI as `python -m analysis` (analysis/__main__.py, its options and outputs).

Run as a script, Python puts `analysis/` itself first on `sys.path`, where `analysis/tables.py`
would shadow PyPI's `tables`; the script swaps that entry for the repository root before it imports
anything, and does nothing at all when imported as a module.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))
    from analysis.__main__ import main

    sys.exit(main())
