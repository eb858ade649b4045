"""Tests of sweeps/ (a package: modules import as tests.sweeps.<name>)."""
