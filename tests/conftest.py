"""Shared pytest fixtures: a seeded RNG for every test, one intra-op thread for the whole suite.

One thread: the suite's tensors are tiny, and on a loaded 2-core machine tiny ops with two intra-op
threads were measured ~1000x slower (a 3x3 softmax: 5 ms vs 3 us)."""

import random

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)
    yield
