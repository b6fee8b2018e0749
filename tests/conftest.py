"""The fixtures that several test files share, and the random state every test starts from.

How the shared test code is laid out: fixtures live here (a test gets one by naming it as an
argument; a file's own fixture of the same name takes precedence); plain helpers, constants and
classes that several files use live in `support.py`; a test file does not import another.

Seeding. Before every test, the autouse fixture `seeded_rngs` seeds torch, NumPy and Python's
`random` with SEED. Without it, a test that draws from a global generator (weights initialised
without a seed of their own, `torch.randn`, `random.choice`, an unseeded sampler) gets whatever
state the tests before it left, which changes with the order tests run in, with which tests
skipped (data present or not) and with what threads did meanwhile: a test that passes alone can
fail in the full suite (issue 36). The seed is fixed, not drawn per run, so that a failure
reproduces when the test runs alone. A fixture broader than one test (module or session scope) is
built when the first test that needs it runs, after whichever test ran before, so it too is seeded
just before it is built (`pytest_fixture_setup` below).

The global seed makes the suite repeatable; it is not what a test's property should rest on. A
test that needs a draw to come out a certain way owns its randomness (a seeded
`torch.Generator`, an engine's `seed`, `SamplingParams.seed`, `random.Random(seed)`), so that
what it depends on is written in the test, and threads that draw from the global generators in
an order timing decides cannot change it.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# The fixtures below import tiderl and `support` when they run, not here: a module of tiderl that
# fails to import then fails the tests that use it, not the collection of the whole suite.

SEED = 0


def seed_everything(seed: int = SEED) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def seeded_rngs() -> None:
    """Every test starts from the same random state (see the module docstring)."""
    seed_everything()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A module- or session-scoped fixture is built from the same random state whichever test
    first asks for it."""
    if fixturedef.scope != "function":
        seed_everything()
    return (yield)


# -- a cache for the warm-started tiny model of configs/kg_sao_tiny.yaml ---------------------


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """`model.cache_dir` for the session's runs (support.small_config and others): each embedded
    model is warm-started once per session, by the first test that needs it, and reused by every
    later run with the same build key. Sharing it cannot make a test depend on the tests before
    it: the cache is keyed by everything a build depends on, and a build is deterministic
    (test_e2e_sao checks both). A test about building itself uses a folder of its own."""
    # Under pytest-xdist (`make test` runs two workers) every worker has a base folder of its own
    # below one shared by the run; the cache sits in the shared one, so a model is built once per
    # run, not once per worker (two workers building the same model at once is safe: a build goes
    # to a folder of its own and is moved into place whole; tiderl/embedded/build.py).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("cache")


# -- a peaky tiny model for the rollout engines ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """A BPE tokenizer (320 tokens) trained on support.CORPUS."""
    from support import CORPUS
    from tiderl.embedded.tiny import train_tokenizer

    return train_tokenizer(CORPUS, vocab_size=320)


@pytest.fixture(scope="module")
def model(tokenizer):
    """support.peaky_model with seed 0: far-from-uniform next-token distributions."""
    from support import peaky_model

    return peaky_model(len(tokenizer), seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Five prompts of different lengths (support.PROMPT_LENGTHS), so that a batch is left-padded."""
    from support import CORPUS, PROMPT_LENGTHS

    return [tokenizer.encode(text, add_special_tokens=False)[:n] for text, n in zip(CORPUS, PROMPT_LENGTHS)]


# -- trajectories for one train_step ------------------------------------------------------------


@pytest.fixture(scope="module")
def trajectories():
    """support.step_trajectories: 8 trajectories in 2 groups of 4 for the 1-layer step model."""
    from support import step_trajectories

    return step_trajectories()


# -- a local Ray cluster for a test module -----------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A 2-CPU local Ray cluster of the module's own (support.local_ray_cluster), shut down after
    the module's last test; skipped where Ray is not installed."""
    pytest.importorskip("ray")
    from support import local_ray_cluster

    yield from local_ray_cluster(request.module.__name__)
