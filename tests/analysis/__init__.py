"""Tests of analysis/ (a package: modules import as tests.analysis.<name>)."""
