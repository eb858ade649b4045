"""mtpc: probabilistic-circuit multi-token heads for exact self-speculative decoding of byte-level LMs.

The package is a pure library (torch, transformers, peft, safetensors). Lightning, Optuna and
MLflow live in experiments/, sweeps/ and analysis/. `MtpcModel` is imported on first use, so
`mtpc.names` (the vocabulary: names and bounds only) can be read by the analysis without loading torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["MtpcModel", "__version__"]

if TYPE_CHECKING:
    from mtpc.speculative import MtpcModel


def __getattr__(name: str):
    if name == "MtpcModel":
        from mtpc.speculative import MtpcModel

        return MtpcModel
    raise AttributeError(f"module 'mtpc' has no attribute {name!r}")
