"""The test suite, laid out like the code: tests/mtpc, tests/tracking, tests/experiments, tests/sweeps, tests/analysis.

Every folder is a package, so pytest imports `tests.mtpc.test_heads` (no basename clashes) and the
shared helpers at this level import as `from tests.backbone_helpers import ...` from any folder.
"""
