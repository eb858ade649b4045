"""Tests of experiments/ (a package: modules import as tests.experiments.<name>)."""
