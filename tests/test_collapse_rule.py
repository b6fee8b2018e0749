"""The collapse rule of tiderl/lab/collapse.py on curves worked out by hand."""

from tiderl.lab.collapse import find_collapse, held_out_collapse, reward_collapse


def test_held_out_needs_two_consecutive_bad_evaluations():
    assert held_out_collapse([(0, 0.2), (10, 0.5), (20, 0.2), (30, 0.4)]) is None  # one dip recovers
    # 0.24 is below half the best (0.25), 0.30 is not: the run resets; 0.10 and 0.15 both are.
    c = held_out_collapse([(0, 0.2), (10, 0.5), (20, 0.24), (30, 0.3), (40, 0.1), (50, 0.15)])
    assert c is not None and (c.step, c.rule) == (50, "held-out")


def test_held_out_below_start_counts():
    c = held_out_collapse([(0, 0.3), (10, 0.35), (20, 0.29), (30, 0.28)])
    assert c is not None and c.step == 30
    assert held_out_collapse([(0, 0.3), (10, 0.31), (20, 0.32)]) is None
    assert held_out_collapse([]) is None


def test_reward_rule_waits_for_patience_and_ignores_runs_that_never_learned():
    learned = [0.1] * 10 + [0.8] * 30 + [0.1] * 40
    c = reward_collapse(learned)
    assert c is not None and c.rule == "reward"
    # The moving average first drops below 0.4 at step 46 (six 0.1s in the window); 20 steps later:
    assert c.step == 65
    assert reward_collapse([0.02] * 100) is None
    assert reward_collapse([0.8] * 30 + [0.1] * 24) is None  # below for 19 steps only


def test_find_collapse_takes_the_earlier_rule():
    curve = [(0, 0.2), (10, 0.5), (20, 0.1), (30, 0.1)]
    rewards = [0.1] * 10 + [0.8] * 30 + [0.1] * 40
    c = find_collapse(curve, rewards)
    assert c is not None and c.step == 30 and c.rule == "held-out"
    assert find_collapse([(0, 0.2), (10, 0.3)], [0.5] * 40) is None
