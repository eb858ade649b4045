"""Shared pytest fixtures: a seeded RNG for every test, and a CPU-only default."""

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)
    yield
