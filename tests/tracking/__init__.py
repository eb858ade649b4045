"""Tests of tracking/ (a package: modules import as tests.tracking.<name>)."""
