"""Where the tests find the target models' own code (EvaByte's, tokenkit's): test oracles, never copied here.

`MTPC_THIRD_PARTY` names a folder laid out as `../shared/third_party/` (`evabyte_hf/`, `tokenkit_hf/`).
- unset: the tests that need it skip, saying so (a user's `make test` without the folder);
- set: the folder and the requested part must exist with every file named, else the test fails — CI sets
  it (`.ci/run`) and fails before the suite when the folder is missing, so a lost oracle never turns
  into silent skips there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV_VAR = "MTPC_THIRD_PARTY"


def third_party(part: str, required: tuple[str, ...] = ()) -> Path:
    """The folder `$MTPC_THIRD_PARTY/<part>`, checked to hold `required` files; skips when the variable is unset."""
    root = os.environ.get(ENV_VAR)
    if not root:
        pytest.skip(
            f"{ENV_VAR} is not set: the real-model conformance tests need the target models' code "
            f"(CI sets it to ../shared/third_party)"
        )
    folder = Path(root).expanduser().resolve() / part
    if not folder.is_dir():
        pytest.fail(f"{ENV_VAR}={root}: no folder {part}/ there (expected the unchanged third-party code)")
    missing = [f for f in required if not (folder / f).is_file()]
    if missing:
        pytest.fail(f"{ENV_VAR}={root}: {part}/ lacks {missing}")
    return folder
