"""benchmarks/online.py: the area, the recovery bookkeeping and the verdict on the SAO/GRPO area
ratio, all fixed before the runs they judge."""

from __future__ import annotations

import pytest

from support import load_benchmark


@pytest.fixture(scope="module")
def online():
    return load_benchmark("online")


def test_the_interval_uses_students_t_at_every_seed_count(online):
    # 16 seeds: t(15) = 2.131, not the normal's 1.96 (the table stopped at 5 degrees of freedom).
    values = [0.0, 1.0] * 8
    mean, half = online.interval(values)
    sd = (sum((v - 0.5) ** 2 for v in values) / 15) ** 0.5
    assert mean == 0.5
    assert half == pytest.approx(2.131 * sd / 4)
    assert online.interval([0.3]) == (0.3, 0.0)


@pytest.mark.parametrize("mean, half, seeds, verdict", [
    (1.30, 0.20, 16, "SAO's area higher"),
    (0.80, 0.15, 16, "SAO's area lower"),
    (1.05, 0.18, 16, "no difference beyond +-0.2"),
    (1.05, 0.35, 16, "undecided (interval holds 1 and is wider than +-0.2)"),
    (1.50, 0.00, 1, "too few seeds"),
])
def test_the_ratio_verdict_follows_the_fixed_rule(online, mean, half, seeds, verdict):
    assert online.ratio_verdict(mean, half, seeds) == verdict


def test_area_and_recovery(online):
    curve = [{"step": 0, "success": 0.2}, {"step": 3, "success": 0.4}, {"step": 6, "success": 0.1},
             {"step": 9, "success": 0.36}, {"step": 12, "success": 0.4}]
    assert online.area(curve) == pytest.approx((0.3 * 3 + 0.25 * 3 + 0.23 * 3 + 0.38 * 3) / 12)
    # A change at step 6 from a pre-change level of 0.4: a drop of 0.3, back within 0.05 at step 9.
    (change,) = online.recoveries(curve, {6: 0.4}, [6], 12)
    assert change == {"change": 6, "level": 0.4, "drop": pytest.approx(0.3), "recover": 3, "censored": False}
    (never,) = online.recoveries(curve, {6: 0.5}, [6], 12)
    assert never["censored"] and never["recover"] == 6


def test_an_override_can_name_the_algorithm_it_is_for(online):
    given = ["seed=3", "sao:algo.critic_warmup_steps=0", "grpo:algo.group_size=4", "run_dir=a:b"]
    assert online.overrides_for("sao", given) == ["seed=3", "algo.critic_warmup_steps=0", "run_dir=a:b"]
    assert online.overrides_for("grpo", given) == ["seed=3", "algo.group_size=4", "run_dir=a:b"]
    assert online.overrides_for("ppo", given) == ["seed=3", "run_dir=a:b"]


def test_the_database_kind_runs_the_shop_presets_with_a_drift_they_accept(online):
    import argparse

    from tiderl.config import load_config

    args = argparse.Namespace(kind="db", every=6, fraction=0.3)
    for algo in ("sao", "grpo"):
        cfg = load_config(online.preset(algo, "db"), online.drift_overrides(args))
        assert (cfg.env.name, cfg.data.source, cfg.algo.name) == ("db", "shop", algo)
        assert cfg.env.options.drift.every_steps == 6
    with pytest.raises(ValueError, match="no preset for --kind db"):
        online.preset("ppo", "db")
    args.kind = "facts"
    assert online.preset("ppo", "facts") == "configs/ppo.yaml"
    assert "env.options.drift.kind=facts" in online.drift_overrides(args)
