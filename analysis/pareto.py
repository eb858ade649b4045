"""`python analysis/pareto.py [options]`: the suite's documented command for the Pareto plots and
tables; the same CLI as `python -m analysis` (analysis/__main__.py, its options and outputs).

No file here shares a name with an installed module (the tables are `paper_tables.py`, not
`tables`, PyTables' name), so running this file as a script is safe; it puts its checkout's root
first on `sys.path`, as `python -m analysis` from the root would, so this checkout's package runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from analysis.__main__ import main

    sys.exit(main())
