"""The experiment layer: Lightning training, evaluation, pre-training, shipping, and their command lines.

One subpackage per job — `training/`, `evaluation/`, `pretraining/`, `shipping/`, and `plumbing/` (what
they share: parsing, run directories, the timing lock, console output) — and the front doors at the top:
`python -m experiments.train`, `experiments.evaluate`, `experiments.pretrain`, `experiments.background`
(the command lines only). docs/FILES.md maps every module.
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
