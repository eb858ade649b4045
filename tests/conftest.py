"""Shared pytest fixtures: a seeded RNG and one intra-op thread for every test.

One thread: the suite's tensors are tiny, and on a loaded 2-core machine tiny ops with two intra-op
threads were measured ~1000x slower (a 3x3 softmax: 5 ms vs 3 us). It is set again before each test
because the code under test may change it (`run.cpu_threads`, `--threads`). This is the only thread
fixture of the suite.

Every test gets its own continuation cache (`MTPC_CONTINUATION_CACHE_DIR` under its tmp_path): offline
evaluations neither read what another test stored nor write into the user's cache."""

import random

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_continuation_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPC_CONTINUATION_CACHE_DIR", str(tmp_path / "continuation_cache"))


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.set_num_threads(1)
    random.seed(0)
    torch.manual_seed(0)
    yield
