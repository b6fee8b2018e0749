"""`benchmarks/async_vs_sync.py`: its modes, its statistics and one tiny run end to end (a smoke
test: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("async_vs_sync", ROOT / "benchmarks" / "async_vs_sync.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["async_vs_sync"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)


def test_modes_run_at_the_concurrency_the_docstring_states():
    modes = {m.name: m for m in bench.MODES}
    b = 16
    assert {n: m.concurrency(b) for n, m in modes.items()} == {
        "sync": 16, "sync-overprov": 32, "sync-3B": 48, "async-s1": 32, "async-s2": 48, "async-s4": 80,
        "async-s1-mask+1": 32, "async-s2-mask+1": 48, "async-s2-mask+2-drain": 48, "async-s2-mask+2-drain-lend": 48}
    assert modes["sync-3B"].concurrency(b) == modes["async-s2"].concurrency(b)
    assert bench.lent_cores_plan([0, 1]) == "trainer=0,1;rollout=1;prep=1"
    assert bench.lent_cores_plan([0, 1, 2, 3]) == "trainer=0,1,2,3;rollout=2,3;prep=2,3"
    assert bench.lent_cores_plan([0]) == "shared"
    assert modes["async-s2-mask+2-drain-lend"].overrides(b)[-1].startswith("system.cores=")
    assert "system.admission=32" in modes["sync-overprov"].overrides(b)
    assert "rollout.batch_size=48" in modes["sync-3B"].overrides(b)
    assert modes["async-s2-mask+1"].overrides(b)[-3:] == ["system.stale.policy=mask", "system.stale.slack=1",
                                                          "system.stale.drain=false"]
    # The drop modes spell out the former rule, whatever tiderl's defaults are.
    assert modes["async-s2"].overrides(b)[-3:] == ["system.stale.policy=drop", "system.stale.slack=0",
                                                   "system.stale.drain=false"]
    assert not any(o.startswith("system.stale.") for o in modes["sync"].overrides(b))
    assert modes["sync-overprov"].overrides(b)[-1] == "system.stale.drain=false"
    assert modes["async-s2-mask+2-drain"].overrides(b)[-3:] == ["system.stale.policy=mask", "system.stale.slack=2",
                                                                "system.stale.drain=true"]


def test_interval_and_paired_ratio():
    mean, half = bench.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(half, 4.30 * 1.0 / math.sqrt(3))
    g, lo, hi = bench.ratio([4.0, 4.0], [2.0, 2.0])
    assert math.isclose(g, 2.0) and math.isclose(lo, 2.0) and math.isclose(hi, 2.0)
    g, lo, hi = bench.ratio([2.0, 8.0], [1.0, 2.0])
    assert math.isclose(g, math.sqrt(8.0)) and lo < g < hi


def _row(mode: str, seed: int, ttt: float, tok: float) -> dict:
    return {"workload": "none", "mode": mode, "seed": seed, "concurrency": 16, "time_to_target_s": ttt,
            "censored": False, "trained_tok_s": tok, "waste": 0.1, "final": 0.4, "dropped": 0, "restarted": 0,
            "unsettled": 0, "staleness_hist": {"0": 16}, "load": [1.0, 1.0]}


def test_headline_compares_async_with_the_strongest_sync_mode():
    rows = [r for s in range(3) for r in (_row("sync", s, 100.0, 10.0), _row("sync-overprov", s, 50.0, 20.0),
                                          _row("async-s2", s, 25.0, 30.0))]
    lines = bench.report(rows, ["none"], bench.MODES)
    assert lines[-1].startswith("none: async-s2 vs strongest sync (sync-overprov), 3 seeds: time to target 2.00x")
    assert "trained tokens/s 1.50x" in lines[-1]


def test_the_goal_line_applies_issue_35s_three_rules():
    def row(mode, seed, tok, waste, length):
        return {**_row(mode, seed, 10.0, tok), "workload": "ln1.0", "waste": waste,
                "lengths": {"length/trained_mean": length, "length/finished_mean": length}}

    sync = [row(m, s, tok, 0.0, 100.0) for s in range(3) for m, tok in (("sync", 10.0), ("sync-3B", 20.0))]
    good = [row(bench.GOAL_MODE, s, 32.0, 0.02, 97.0) for s in range(3)]
    lines = bench.report(sync + good, ["ln1.0"], bench.MODES)
    assert lines[-1].startswith(f"ln1.0: goal of issue 35 for {bench.GOAL_MODE}, 3 seeds: waste 0.020")
    assert "0.970x sync's" in lines[-1] and "1.60x [1.60-1.60] the fastest sync (sync-3B" in lines[-1]
    assert lines[-1].endswith("PASS")
    for bad in ([row(bench.GOAL_MODE, s, 32.0, 0.06, 97.0) for s in range(3)],    # waste
                [row(bench.GOAL_MODE, s, 32.0, 0.02, 90.0) for s in range(3)],    # length bias
                [row(bench.GOAL_MODE, s, 28.0, 0.02, 97.0) for s in range(3)]):   # 1.4x < 1.5x
        assert bench.report(sync + bad, ["ln1.0"], bench.MODES)[-1].endswith("FAIL")
    # Without tool latency the throughput rule is 0.9x.
    slow = [row(bench.GOAL_MODE, s, 19.0, 0.02, 97.0) for s in range(3)]
    assert bench.report([{**r, "workload": "none"} for r in sync + slow], ["none"], bench.MODES)[-1].endswith("PASS")


def test_generation_budgets_are_heavy_tailed_and_fixed_by_the_seed():
    median, sigma, cap = bench.WORKLOADS["longgen"].gen_budget
    draws = [bench.draw_budget(median, sigma, cap, bench.random.Random(i)) for i in range(4000)]
    again = [bench.draw_budget(median, sigma, cap, bench.random.Random(i)) for i in range(4000)]
    d = bench.percentiles(draws)
    assert draws == again and 1 <= min(draws) and max(draws) <= cap
    assert abs(d["p50"] - median) <= 4  # log-normal: the median is exp(mu)
    assert d["p99"] > 10 * median and d["mean"] > 1.5 * median
    assert bench.percentiles([5, 1, 3]) == {"n": 3, "mean": 3.0, "p50": 3, "p99": 5, "max": 5}


class _AnswerAtOnce:
    """Answers on its first step (reward 1), or never (done=False) with `answer=False`."""

    def __init__(self, answer: bool = True):
        self.answer, self.finished = answer, []

    def step(self, action):
        return bench.StepResult([], reward=1.0, done=True) if self.answer else bench.StepResult(["obs"])

    def finish(self, reason):
        self.finished.append(reason)
        return bench.StepResult([], reward=0.0, done=True)


class _Action:
    def __init__(self, text):
        self.text = text


def test_budget_env_holds_the_answer_back_until_the_budget_is_spent():
    def count(text):  # one token per word, +1 for the end of turn
        return len(text.split()) + 1

    env = bench.GenerationBudgetEnv(_AnswerAtOnce(), budget=10, count=count)
    first = env.step(_Action("a b c"))  # 4 tokens: the answer is held back
    assert not first.done and first.observations == [bench.CONTINUE]
    assert not env.step(_Action("d e")).done  # 7
    last = env.step(_Action("f g h"))  # 11 >= 10: the held answer ends it
    assert last.done and last.reward == 1.0
    # A budget spent before the answer changes nothing.
    assert bench.GenerationBudgetEnv(_AnswerAtOnce(), budget=2, count=count).step(_Action("a b")).done
    # The inner environment's own turn limit still ends its part; the loop's limit returns the held result.
    inner = _AnswerAtOnce(answer=False)
    env = bench.GenerationBudgetEnv(inner, budget=1000, count=count)
    for _ in range(bench.NATURAL_MAX_TURNS):
        assert not env.step(_Action("x")).done
    assert inner.finished == ["max_turns"] and env.finish("max_tokens").reward == 0.0


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the asynchronous plan needs 2 cores")
def test_one_tiny_asynchronous_run_reports_its_figures_and_placement(cache, tmp_path):
    from support import small_config
    from tiderl.envs.setup import load_setup
    from tiderl.embedded.build import ensure_embedded_model

    # The tests' small warm-started model (support.small_config, shared through `cache`), not the
    # config's own embedded model: that one takes 400 warm-start steps on 3000 traces to build,
    # minutes on a fresh clone, and nothing below depends on how well the policy was warm-started.
    small = small_config(cache, tmp_path / "build")
    model = ensure_embedded_model(small, load_setup(small))
    mode = next(m for m in bench.MODES if m.name == "async-s1")
    row = bench.run_mode(mode, "none", seed=0, b=4, steps=2, eval_every=2, eval_n=4, out=tmp_path, evaluated={},
                         model=str(model))
    assert row["steps"] == 2 and row["trained"] == 8
    assert 0.0 <= row["waste"] < 1.0 and row["decoded_tokens"] >= row["trained_sampled_tokens"] > 0
    # The pool's account (finished episodes' tokens plus the cut-off ones the local backend counts)
    # is the benchmark's (every completed turn decoded), token for token.
    assert row["pool_waste"]["waste_frac"] == pytest.approx(row["waste"])
    assert set(row["lengths"]) >= {"length/trained_mean", "length/finished_mean", "length/ks_d", "length/ks_p"}
    assert [p["step"] for p in row["curve"]] == [0, 2]
    plan = row["core_plan"]
    assert set(plan) == {"trainer", "rollout", "prep"} and not set(plan["trainer"]) & set(plan["rollout"])
    for component, cores in row["ran_on"].items():  # threads seen running only where they were pinned
        assert set(cores) <= set(plan[component]), (component, cores, plan)
    # What the simulator is fed: finished episodes' turns, env step times, decode and train timings.
    m = row["measured"]
    assert len(m["profiles"]) >= 8 and all(min(p) >= 1 for p in m["profiles"])
    assert len(m["env_step_s"]) >= sum(len(p) for p in m["profiles"])  # unfinished episodes' steps too
    assert len(m["env_step_own_s"]) == len(m["env_step_s"]) and 0 < sum(m["env_step_own_s"]) <= sum(m["env_step_s"])
    assert sum(c for c, _ in m["decode_steps"].values()) > 0 and len(m["steps"]) == 2
    assert row["episode_tokens"]["trained"]["n"] == 8


def test_eval_every_below_one_is_refused_with_the_fix(monkeypatch, capsys):
    """`--eval-every 0` once reached a modulo by zero after a run's first step."""
    monkeypatch.setattr(sys, "argv", ["async_vs_sync.py", "--eval-every", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "--eval-every is 0: it must be 1 or more" in capsys.readouterr().err
