"""Where mtpc keeps what it builds on first use (processed data, the embedded default model).

Only path logic lives here; nothing is created until a caller asks for a directory.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "MTPC_CACHE_DIR"


def cache_dir() -> Path:
    """`$MTPC_CACHE_DIR` if set, else `~/.cache/mtpc` (not created here)."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtpc"
