"""mtpc: probabilistic-circuit multi-token heads for exact self-speculative decoding of byte-level LMs.

The package is a pure library (torch, transformers, peft, safetensors). Lightning, Optuna and
MLflow live in experiments/, sweeps/ and analysis/.
"""

__version__ = "0.1.0"

from mtpc.speculative import MtpcModel  # noqa: E402

__all__ = ["MtpcModel", "__version__"]
