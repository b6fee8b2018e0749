"""The generated one-line functions (`data.source=funcs`, tiderl/envs/code/funcs.py): held-out tasks
are (name, operation) rows no training task has, the reference passes every task's hidden tests in
the sandbox and the partner operation fails them, and the warm start's demonstrations submit the
partner at each kind's rate."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from tiderl.config import load_config
from tiderl.envs.code.env import score
from tiderl.envs.code.env import tool_call_text
from tiderl.envs.code.funcs import (KINDS, confusion_rates, copy_check, copy_check_tasks, demonstrations,
                                    function_code, funcs_tasks)
from tiderl.envs.code.setup import shared_sandbox
from tiderl.envs.setup import load_setup

ARGS = ["env.name=code", "data.source=funcs", "data.eval_size=80", "model.path=tiny"]


@pytest.fixture(scope="module")
def funcs():
    cfg = load_config(None, ARGS)
    return cfg, load_setup(cfg)


def _passes(task, code: str) -> bool:
    """Whether `code` passes the task's hidden asserts (in this process: our own generated code)."""
    scope: dict = {}
    try:
        exec(code + "\n" + task.answer["tests"], scope)  # noqa: S102
    except AssertionError:
        return False
    return True


def test_held_out_tasks_are_rows_no_training_task_has():
    train, held_out = funcs_tasks(0)
    assert (len(train), len(held_out)) == (1280, 320)
    key = lambda t: (t.meta["entry_points"][0], t.meta["kind"])  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in held_out}
    # ... while every held-out name is a training name of other kinds (the tokenizer and the warm
    # start know it), and the same seed gives the same tasks.
    assert {t.meta["entry_points"][0] for t in held_out} <= {t.meta["entry_points"][0] for t in train}
    assert {t.meta["kind"] for t in held_out} == set(KINDS)
    assert [t.prompt for t in funcs_tasks(0)[1]] == [t.prompt for t in held_out] != [t.prompt for t in funcs_tasks(1)[1]]
    task = held_out[0]
    name = task.meta["entry_points"][0]
    assert f'"def {name}(x):"' in task.prompt and task.meta["reference"].startswith(f"def {name}(x):")
    assert re.search(rf"^assert {name}\(3\) == -?\d+$", task.prompt, re.MULTILINE)  # one test shown


def test_the_reference_passes_and_the_partner_fails_every_task():
    train, held_out = funcs_tasks(0)
    for task in train + held_out:
        name, kind, k = task.meta["entry_points"][0], task.meta["kind"], task.meta["constant"]
        assert _passes(task, task.meta["reference"]), task.task_id
        assert not _passes(task, function_code(name, KINDS[kind][2], k)), task.task_id


def test_the_sandbox_scores_the_reference_and_the_partner(funcs):
    cfg, setup = funcs
    sandbox = shared_sandbox(setup, cfg)
    tasks = [next(t for t in setup.eval_tasks if t.meta["kind"] == kind) for kind in sorted(KINDS)]

    async def both(task):
        name, kind, k = task.meta["entry_points"][0], task.meta["kind"], task.meta["constant"]
        right = await score(sandbox, task, task.meta["reference"])
        wrong = await score(sandbox, task, function_code(name, KINDS[kind][2], k))
        return right[0], wrong[0]

    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(*(both(t) for t in tasks)), 120)

    results = asyncio.run(all_of_them())
    assert results == [(True, False)] * len(KINDS)


def test_demonstrations_submit_the_partner_at_each_kinds_rate(funcs):
    cfg, setup = funcs
    rates = confusion_rates(0.5, cfg.seed)
    tasks, scripts, report = demonstrations(setup, cfg, random.Random(0))
    assert len(tasks) == cfg.model.warmstart.num_traces
    assert report["confusion_rates"] == {k: round(r, 3) for k, r in rates.items()}
    wrong: dict[str, list[int]] = {k: [0, 0] for k in KINDS}
    for task, script in zip(tasks, scripts):
        assert len(script) == 1 and '"name": "submit"' in script[0]
        kind = task.meta["kind"]
        wrong[kind][0] += task.meta["reference"].replace("\n", "\\n") not in script[0]
        wrong[kind][1] += 1
    for kind, (failed, n) in wrong.items():
        assert abs(failed / n - rates[kind]) < 4 * (rates[kind] * (1 - rates[kind]) / n) ** 0.5, kind


def test_each_pair_has_one_confused_kind_and_the_words_decide():
    """One kind of each pair mostly submits the partner's operation (its greedy choice is wrong), the
    other mostly its own; so each operation is likelier for its own kind than for the partner kind
    (the demonstrations show that the words decide, which a pair with rates summing to 1 does not)."""
    for seed in range(5):
        rates = confusion_rates(0.5, seed)
        assert set(rates) == set(KINDS)
        confused = sorted(round(r, 3) for r in rates.values() if r > 0.5)
        assert confused == [0.55, 0.617, 0.683, 0.75], seed
        for kind, (_, _, partner) in KINDS.items():
            assert min(rates[kind], rates[partner]) == pytest.approx(0.1), (seed, kind)
            assert (1 - rates[kind]) - rates[partner] > 0.15 - 1e-9, (seed, kind)  # P(op | kind) - P(op | partner)
    assert confusion_rates(0.5, 0) != confusion_rates(0.5, 1)


def test_the_copy_check_asks_training_tasks_the_demonstrations_never_show(funcs):
    cfg, setup = funcs
    kept_out = {t.task_id for t in copy_check_tasks(setup, cfg.seed)}
    assert len(kept_out) == len(setup.train_tasks) // 8
    tasks, _, _ = demonstrations(setup, cfg, random.Random(0))
    assert not kept_out & {t.task_id for t in tasks}
    checked, turns, copied = copy_check(setup, cfg)
    assert {t.task_id for t in checked} <= kept_out and len(checked) == min(len(kept_out), 400)
    for task, (turn,) in zip(checked, turns):
        name, kind, k = task.meta["entry_points"][0], task.meta["kind"], task.meta["constant"]
        assert copied(task, turn)
        assert copied(task, tool_call_text("submit", {"code": function_code(name, KINDS[kind][2], k)}))
        assert not copied(task, tool_call_text("submit", {"code": function_code(name, kind, k % 9 + 2)}))
        assert not copied(task, tool_call_text("submit", {"code": function_code(name + "a", kind, k)}))


def test_the_tiny_model_is_built_on_funcs_only():
    cfg = load_config(None, ["env.name=code", "data.source=mbpp", "model.path=tiny"])
    setup = type("S", (), {"name": "mbpp", "train_tasks": []})()
    with pytest.raises(ValueError, match="data.source=funcs"):
        demonstrations(setup, cfg, random.Random(0))


@pytest.mark.parametrize("name", ["code_funcs_sao_tiny", "code_funcs_grpo_tiny"])
def test_the_configs_load(name):
    cfg = load_config(f"configs/{name}.yaml", [])
    assert (cfg.env.name, cfg.data.source, cfg.model.path) == ("code", "funcs", "tiny")
