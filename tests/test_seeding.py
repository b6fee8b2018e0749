"""conftest.py's seeding: every test, and every fixture broader than a test, starts from the same
random state whatever ran before it (issue 36)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


def draws() -> tuple[float, float, list[float]]:
    """One draw from each global generator: Python's `random`, NumPy's, torch's."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def seeded_draws(seed: int) -> tuple[float, float, list[float]]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return draws()


@pytest.fixture(scope="module")
def module_draws():
    """Built when the first test of this module that asks for it runs, after whatever ran before."""
    return draws()


@pytest.mark.parametrize("consumed", [0, 1, 1000])
def test_each_test_starts_from_the_seeded_state(consumed):
    # Each case draws first, then consumes more of every generator: whichever case runs after
    # another still starts from the same state, that of seed 0.
    first = draws()
    for _ in range(consumed):
        draws()
    assert first == seeded_draws(0)


def test_a_module_fixture_is_built_from_the_seeded_state(module_draws):
    # In file order the cases above consumed the generators before this fixture was built.
    assert module_draws == seeded_draws(0)
