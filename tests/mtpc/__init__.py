"""Tests of mtpc/ (a package: modules import as tests.mtpc.<name>)."""
