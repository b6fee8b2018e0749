"""Goodput, critic-value lag and the statistics of run comparisons (docs/metrics.md).

The rollout pool's parts use the fake backend and trainer of pool_fakes (no model); the critic
snapshot's stamp uses a two-layer tiny model.
"""

from __future__ import annotations

import math

import pytest
import torch

from pool_fakes import FakeRollout, FakeTrainer, run_pool
from tiderl.config import AlgoConfig, load_config, preset_defaults
from tiderl.lab.compare import (
    first_reaching,
    mean_ci,
    mean_over_tokens,
    paired_difference,
    t_quantile_95,
    trainer_token_passes,
    verdict,
)
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.pool import PoolSettings, critic_value_lags, lag_metrics
from tiderl.types import NO_VERSION, Trajectory

# --- comparing runs -------------------------------------------------------------------------------


def test_mean_over_tokens_is_the_area_under_the_curve_per_token():
    curve = [{"generated_tokens": 0, "success": 0.2}, {"generated_tokens": 100, "success": 0.6},
             {"generated_tokens": 300, "success": 0.6}]
    assert mean_over_tokens(curve) == pytest.approx((100 * 0.4 + 200 * 0.6) / 300)
    # A run that learns earlier has the larger area at the same final success.
    late = [{"generated_tokens": 0, "success": 0.2}, {"generated_tokens": 200, "success": 0.2},
            {"generated_tokens": 300, "success": 0.6}]
    assert mean_over_tokens(late) < mean_over_tokens(curve)
    assert mean_over_tokens(curve[:1]) == 0.2
    with pytest.raises(ValueError):
        mean_over_tokens([])


def test_mean_ci_is_the_t_interval_and_unknown_for_one_value():
    ci = mean_ci([1.0, 2.0, 3.0])  # sd 1, se 1/sqrt(3), t(2) = 4.303
    assert ci["mean"] == 2.0 and ci["se"] == pytest.approx(1 / math.sqrt(3))
    assert ci["lo"] == pytest.approx(2 - 4.303 / math.sqrt(3)) and ci["hi"] == pytest.approx(2 + 4.303 / math.sqrt(3))
    assert math.isnan(mean_ci([0.5])["se"])
    assert t_quantile_95(4) == 2.776 and t_quantile_95(1000) == 1.96
    with pytest.raises(ValueError):
        mean_ci([])


def test_paired_difference_cancels_the_shared_seed_effect():
    # Seeds move both runs a lot; the pairing sees only the steady 0.02 gap.
    a = {0: 0.30, 1: 0.52, 2: 0.41, 3: 0.25}
    b = {0: 0.28, 1: 0.50, 2: 0.39, 3: 0.23, 9: 0.9}  # seed 9 has no partner: left out
    d = paired_difference(a, b)
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.02) and d["lo"] > 0
    assert mean_ci(list(a.values()))["lo"] < mean_ci(list(b.values()))["hi"]  # unpaired: overlapping
    with pytest.raises(ValueError, match="no seed"):
        paired_difference({0: 1.0}, {1: 1.0})


def test_verdict_needs_the_whole_interval_on_one_side_of_zero():
    assert verdict({"se": 0.01, "lo": 0.001, "hi": 0.05}) == "SAO higher"
    assert verdict({"se": 0.01, "lo": -0.05, "hi": -0.001}) == "SAO lower"
    assert verdict({"se": 0.01, "lo": -0.01, "hi": 0.05}) == "no difference shown"
    assert verdict(mean_ci([0.1])) == "too few seeds"
    assert verdict(mean_ci([0.05, 0.06, 0.07]), "learns", "gets worse") == "learns"


def test_first_reaching_is_time_to_accuracy_or_inf():
    curve = [{"success": 0.2, "train_s": 0}, {"success": 0.24, "train_s": 50}, {"success": 0.26, "train_s": 90}]
    assert first_reaching(curve, 0.25) == 90
    assert first_reaching(curve, 0.2) == 0
    assert first_reaching(curve, 0.3) == math.inf


def algo(name: str, **overrides) -> AlgoConfig:
    return AlgoConfig(**{**preset_defaults(name), **overrides})


def test_trainer_token_passes_count_each_pass_of_the_algorithm():
    sao = algo("sao", critic_updates=2)  # values forward, 2 critic updates, 1 actor update
    assert trainer_token_passes(sao, 100, train_actor=True) == {"fwd_bwd": 300, "fwd": 100}
    assert trainer_token_passes(sao, 100, train_actor=False) == {"fwd_bwd": 200, "fwd": 100}  # warm-up
    grpo = algo("grpo", kl_coef=0.04)  # no critic; the reference's forward
    assert trainer_token_passes(grpo, 100, train_actor=True) == {"fwd_bwd": 100, "fwd": 100}
    ppo = algo("ppo", critic_updates=1, actor_updates=4, old_logprobs="recompute", advantage_values="after")
    assert trainer_token_passes(ppo, 10, train_actor=True) == {"fwd_bwd": 50, "fwd": 30}


# --- goodput in the rollout pool ------------------------------------------------------------------


def run(settings: PoolSettings, trainer, steps: int, buffer: ReadyBuffer | None = None):
    return run_pool(settings, FakeRollout(lambda _: 0.002), trainer, steps, buffer)


def test_goodput_counts_the_sampled_tokens_of_trained_trajectories_only():
    # A fake trajectory has 3 tokens of which 2 were sampled (the first is the prompt).
    s, history = run(PoolSettings(batch_size=4, max_staleness=1, resource_units=2.0), FakeTrainer(), 3)
    last = history[-1]
    assert last["system/trained_action_tokens"] == 3 * 4 * 2
    assert last["system/trained_sequence_tokens"] == 3 * 4 * 3
    assert last["system/generated_tokens"] >= last["system/trained_action_tokens"]
    ratio = last["throughput/goodput_tokens_per_s"] / last["throughput/trained_sequence_tokens_per_s"]
    assert ratio == pytest.approx(2 / 3)
    assert last["throughput/goodput_tokens_per_s_per_unit"] == pytest.approx(last["throughput/goodput_tokens_per_s"] / 2)
    summary = s.summary()
    assert summary["trained_action_tokens"] == 24 and summary["trained_sequence_tokens"] == 36
    assert "system/prep_overlap_frac" not in last


def test_a_skipped_optimizer_step_is_not_goodput():
    skipping = FakeTrainer(metrics=lambda version: {"nonfinite/skipped_step": 1.0} if version == 0 else {"loss": 0.0})
    _, history = run(PoolSettings(batch_size=4), skipping, 2)
    assert history[0]["system/trained_action_tokens"] == 0
    assert history[1]["system/trained_action_tokens"] == 8


def test_resource_units_must_be_positive():
    with pytest.raises(ValueError, match="system.resource_units"):
        load_config("configs/sao.yaml", ["system.resource_units=0"])
    assert PoolSettings.from_config(load_config("configs/sao.yaml", ["system.resource_units=8"])).resource_units == 8


# --- critic-value lag -----------------------------------------------------------------------------


def stamped(version: float | None) -> Trajectory:
    t = Trajectory(tokens=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], policy_version=[NO_VERSION, 0])
    if version is not None:
        t.annotations["values_version"] = [version, version]
    return t


def test_lag_is_the_refreshes_since_the_values_were_computed():
    batch = [stamped(3.0), stamped(1.0), stamped(None), stamped(3.0)]
    assert critic_value_lags(batch, 3) == [0, 2, 0]
    m = lag_metrics([0, 2, 0])
    assert m == {"critic/lag_mean": pytest.approx(2 / 3), "critic/lag_max": 2.0, "critic/lag_0": 2.0, "critic/lag_2": 1.0}
    assert lag_metrics([]) == {}


class StampingSnapshot:
    """Stands for CriticSnapshot: stamps its refresh count; the trainer refreshes it every step."""

    def __init__(self):
        self.refreshes = 0

    def __call__(self, trajectories):
        for t in trajectories:
            t.annotations["values_version"] = [float(self.refreshes)] * len(t.tokens)


def refreshing_trainer(snapshot: StampingSnapshot) -> FakeTrainer:
    """A trainer that refreshes the snapshot after every step, as the real one does."""
    trainer = FakeTrainer(lambda: 0.01)

    def refresh(version: int) -> None:
        snapshot.refreshes += 1

    trainer.after = refresh
    return trainer


@pytest.mark.parametrize("staleness", [0, 2])
def test_pool_logs_the_lag_histogram_within_the_staleness_bound(staleness):
    snap = StampingSnapshot()
    settings = PoolSettings(batch_size=4, max_staleness=staleness)
    s, history = run(settings, refreshing_trainer(snap), 6, ReadyBuffer([snap], 1))
    hist = s.summary()["critic_lag_histogram"]
    assert sum(hist.values()) == 6 * 4
    # Values are computed after the episode ends, so they lag by at most the staleness bound.
    assert max(hist) <= staleness
    if staleness:
        assert max(hist) >= 1  # with episodes overlapping the steps, some values are older
    for m in history:
        assert sum(v for k, v in m.items() if k.startswith("critic/lag_") and k[11:].isdigit()) == 4


def test_critic_snapshot_stamps_the_refresh_count_it_computed_with():
    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
    from tiderl.train.annotate import CriticSnapshot
    from tiderl.train.critic import ValueModel

    cfg = tiny_qwen2_config(50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_position_embeddings=64)
    critic = ValueModel.from_policy(init_tiny_model(cfg, seed=0))
    snap = CriticSnapshot(critic, pad_id=0, micro_batch_tokens=64, device="cpu")
    first = [stamped(None) for _ in range(2)]
    snap(first)
    with torch.no_grad():
        critic.head.bias.fill_(1.0)
    snap.refresh(critic)
    snap.refresh(critic)
    second = [stamped(None)]
    snap(second)
    assert [t.annotations["values_version"] for t in first] == [[0.0, 0.0]] * 2
    assert second[0].annotations["values_version"] == [2.0, 2.0]
    assert second[0].annotations["values"] != first[0].annotations["values"]  # refreshed weights
