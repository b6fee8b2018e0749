"""Waste and length bias (issue 35; docs/metrics.md, "Waste and length bias"): the tally and the
two-sample statistic, the rollout pool's account of every sampled token (fake backend and
trainer, known episode lengths), and the simulator's, which tallies lengths the same way; the
stale policies (`system.stale`: drop, or mask the too-stale tokens; the bound on trained tokens)
in the rule, the pool, the config and the simulator."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path

import pytest

from pool_fakes import FakeRollout, FakeTrainer, check_ledger, fake_trajectory, run_pool
from tiderl.config import load_config
from tiderl.envs.protocol import Task
from tiderl.lab.simulate import Cluster, Dist, Schedule, Workload, simulate
from tiderl.options import ConfigError
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.ledger import Lengths, ks_two_sample, quantile
from tiderl.system.pool import PoolSettings
from tiderl.system.staleness import StalenessGate, too_stale

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


# --- the statistics --------------------------------------------------------------------------------


def test_quantiles_are_nearest_rank_over_the_tally():
    tally = Counter({10: 8, 50: 2})  # 10 values: eight 10s, two 50s
    assert quantile(tally, 0.5) == 10 and quantile(tally, 0.8) == 10 and quantile(tally, 0.9) == 50
    assert quantile(Counter(), 0.5) == 0.0


def test_ks_two_sample_statistic_and_p_value():
    # D is the largest gap between the two empirical CDFs: {1,2,3} vs {2,3,4} differ by 1/3 at 1.
    d, p = ks_two_sample(Counter({1: 1, 2: 1, 3: 1}), Counter({2: 1, 3: 1, 4: 1}))
    assert d == pytest.approx(1 / 3) and p > 0.9
    assert ks_two_sample(Counter({5: 4}), Counter({5: 9})) == (0.0, 1.0)
    assert ks_two_sample(Counter(), Counter({5: 1})) == (0.0, 1.0)
    # Large samples: x = (sqrt(ne) + 0.12 + 0.11/sqrt(ne)) D; the Kolmogorov tail is 0.0494 at
    # x = 1.36 and 0.0100 at 1.628 (its tables).
    n = 5000
    for x, tail in ((1.36, 0.0494), (1.628, 0.0100)):
        k = x / (50 + 0.12 + 0.11 / 50) * n  # sqrt(ne) = sqrt(n / 2) = 50
        a, b = Counter({0: n}), Counter({0: n - round(k), 1: round(k)})
        d, p = ks_two_sample(a, b)
        assert d == pytest.approx(round(k) / n) and p == pytest.approx(tail, abs=0.002)
    d, p = ks_two_sample(Counter({0: 100}), Counter({1: 100}))
    assert d == 1.0 and p < 1e-20


def test_lengths_report_both_distributions_and_their_gap():
    m = Lengths(finished={10: 8, 50: 2}, trained={10: 8}).metrics()
    assert m["length/trained_mean"] == 10 and m["length/finished_mean"] == 18
    assert (m["length/trained_p50"], m["length/trained_p90"]) == (10, 10)
    assert (m["length/finished_p50"], m["length/finished_p90"]) == (10, 50)
    assert m["length/ks_d"] == pytest.approx(0.2)


# --- the rollout pool ------------------------------------------------------------------------------


def long_and_short(long_tasks: set[str], until: int, trainer: FakeTrainer) -> FakeRollout:
    """Tasks in `long_tasks` sample 50 tokens and run until the trainer has reached version
    `until`; every other task samples 10 tokens at once."""
    event = asyncio.Event()
    trainer.after = lambda version: event.set() if version >= until else None
    return FakeRollout(wait=lambda tid: event if tid in long_tasks else None,
                       length=lambda tid: 50 if tid in long_tasks else 10)


def test_dropping_the_long_episodes_shows_as_exact_waste_and_length_gap():
    # t0 and t1 start at version 0 and finish once the trainer is at version 4: judged 4 or
    # more versions old against a bound of 1, both are dropped. Everything else is 10 tokens.
    trainer = FakeTrainer()
    rollout = long_and_short({"t0", "t1"}, 4, trainer)
    pool, history = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), rollout, trainer, steps=12)
    assert pool.ledger.dropped_stale == 2
    last = history[-1]
    assert last["system/wasted_tokens"] == 100
    assert last["system/waste_frac"] == 100 / last["system/generated_tokens"]
    assert last["length/trained_mean"] == last["length/trained_p90"] == 10
    # After the run: every finished episode (what the fake finished) against the trained ones.
    finished = Counter(rollout.length(tid) for tid, _ in rollout.finishes)
    assert pool.lengths.finished == finished and finished[50] == 2
    assert pool.lengths.trained == {10: 24}
    n = sum(finished.values())
    m = pool.lengths.metrics()
    assert m["length/finished_mean"] == (10 * (n - 2) + 100) / n
    assert m["length/ks_d"] == pytest.approx(2 / n)  # the finished CDF at 10 is (n - 2) / n
    waste = pool.summary()["waste"]
    unsettled = 10 * (n - 2 - 24)  # finished, neither trained nor dropped: still buffered at the end
    assert (waste["dropped_stale"], waste["unsettled"], waste["cut"]) == (100, unsettled, rollout.cut_tokens)
    assert waste["waste_frac"] == (100 + unsettled + rollout.cut_tokens) / (pool.generated_tokens + rollout.cut_tokens)
    check_ledger(pool)


def test_every_sampled_token_is_trained_wasted_or_unsettled():
    # Over-provisioned on-policy training restarts what runs on old weights (cut tokens); faulted
    # episodes' tokens are wasted too.
    trainer = FakeTrainer(lambda: 0.01)
    rollout = FakeRollout(lambda tid: 0.006 * (int(tid[1:]) % 7), length=lambda tid: 3 + int(tid[1:]) % 5,
                          fail=lambda tid, attempt: "env" if int(tid[1:]) % 9 == 4 and attempt == 0 else "")
    pool, history = run_pool(PoolSettings(batch_size=4, max_staleness=0, admission=8), rollout, trainer, steps=8)
    waste = pool.summary()["waste"]
    assert pool.ledger.restarted > 0 and waste["cut"] == rollout.cut_tokens > 0 and waste["faulted"] > 0
    trained = history[-1]["system/trained_action_tokens"]
    assert pool.generated_tokens == trained + waste["dropped_stale"] + waste["faulted"] + waste["unsettled"]
    assert waste["wasted_tokens"] == sum(v for k, v in waste.items() if k not in ("wasted_tokens", "waste_frac"))
    check_ledger(pool)


def test_a_resumed_pool_keeps_counting_from_the_checkpoint():
    trainer = FakeTrainer()
    rollout = long_and_short({"t0"}, 4, trainer)
    pool, _ = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), rollout, trainer, steps=8)
    state = pool.state_dict()
    again, _ = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), FakeRollout(length=lambda _: 7),
                        FakeTrainer(), steps=0)
    again.load_state_dict(state, task_of=lambda tid: None)
    assert again.lengths.finished == pool.lengths.finished and again.lengths.trained == pool.lengths.trained
    assert again.wasted["dropped_stale"] == 50 and again.wasted["cut"] == state["wasted"]["cut"]


def test_every_pool_metric_is_defined_in_docs_metrics():
    trainer = FakeTrainer()
    _, history = run_pool(PoolSettings(batch_size=2, max_staleness=1), FakeRollout(), trainer, steps=2)
    documented = set(re.findall(r"`([a-z_]+/[a-z0-9_]+)`", DOCS.read_text()))
    missing = sorted(k for k in history[-1] if "/" in k and k not in documented)
    assert missing == [], missing


# --- the simulator ---------------------------------------------------------------------------------


def test_the_simulator_tallies_lengths_as_the_pool_does():
    # Episodes of 1 or 3 turns of 10 tokens with 1 s tools, a 0.5 s step: at staleness 1 the
    # 3-turn episodes span versions and are dropped; sync trains whatever it starts.
    two = Workload(episodes=((10,), (10, 10, 10)), tool_latency_s=Dist("const", 1.0))
    one = Cluster(engines=1, engine_max_seqs=64, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                  train_step_s=0.5, sync_s=0.0)
    sync = simulate(two, one, Schedule(max_staleness=0, batch_size=8, steps=6), seed=1)
    assert sync.lengths["length/ks_d"] == 0.0 and sync.trained_length == sync.tokens_per_trajectory
    asynchronous = simulate(two, one, Schedule(max_staleness=1, batch_size=8, steps=6), seed=1)
    assert asynchronous.dropped > 0
    assert asynchronous.trained_length < asynchronous.finished_length and asynchronous.ks_d > 0
    assert asynchronous.trained_length == asynchronous.trained_tokens / asynchronous.trained


# --- stale policies ------------------------------------------------------------------------------


def test_the_rule_drops_or_masks_exactly_the_tokens_older_than_the_bound():
    counts = {3: 25, 4: 25}  # 25 tokens sampled on version 3, 25 on version 4
    assert too_stale(counts, trainer_version=5, bound=2) == 0  # oldest 3 >= 5 - 2: trains whole
    assert too_stale(counts, 5, 1) is None  # drop: one token too old spoils it
    assert too_stale(counts, 5, 1, "mask") == 25  # mask: the version-3 tokens
    assert too_stale(counts, 6, 1, "mask") is None  # every token too old: dropped anyway
    assert too_stale({}, 9, 0, "mask") == 0  # nothing sampled: staleness 0
    gate = StalenessGate(max_staleness=1, batch_size=2, policy="mask", bound=2)
    t = fake_trajectory(Task("a", "q", None), "g", 2, 5, length=6)  # 3 tokens on version 2, 3 on 5
    assert gate.judge(t, trainer_version=5) == 3 and gate.dropped == 0 and gate.histogram == {3: 1}
    with pytest.raises(ValueError, match="stale bound 1 is below max_staleness=2"):
        StalenessGate(max_staleness=2, batch_size=2, bound=1)
    with pytest.raises(ValueError, match="use one of drop, mask"):
        StalenessGate(max_staleness=2, batch_size=2, policy="trim")


@pytest.mark.parametrize("policy", ["drop", "mask"])
def test_mask_keeps_the_long_episodes_that_drop_throws_away(policy):
    # As above, t0 and t1 (50 tokens: 25 on version 0, 25 on the version they end on, 3 or 4)
    # finish once the trainer is at 4; admission at 1, trained tokens bounded by 3. Drop: both
    # are dropped (staleness >= 4). Mask: both train, with exactly their 25 version-0 tokens masked.
    trainer = FakeTrainer()
    rollout = long_and_short({"t0", "t1"}, 4, trainer)
    settings = PoolSettings(batch_size=2, max_staleness=1, slots=4, stale_policy=policy, stale_bound=3)
    pool, history = run_pool(settings, rollout, trainer, steps=12)
    trained = [(version, t) for version, batch, _, _ in trainer.batches for t in batch]
    for version, t in trained:  # no trained token older than the bound
        assert all(v >= version - 3 for v, m in zip(t.policy_version, t.loss_mask) if m)
    long_trained = [t for _, t in trained if t.task_id in ("t0", "t1")]
    waste = pool.summary()["waste"]
    if policy == "drop":
        assert pool.ledger.dropped_stale == 2 and not long_trained and waste["dropped_stale"] == 100
        assert pool.lengths.trained == {10: 24}
    else:
        assert pool.ledger.dropped_stale == 0 and len(long_trained) == 2
        assert all(t.num_action_tokens == 25 for t in long_trained) and waste["masked"] == 50
        assert pool.lengths.trained == {10: 22, 50: 2}  # the episodes' whole lengths
        assert history[-1]["system/staleness_max"] <= 3
        assert history[-1]["system/trained_action_tokens"] == 22 * 10 + 2 * 25
    check_ledger(pool)


def test_mask_keeps_a_group_whose_member_is_partly_too_old():
    # Groups of 2; the first group's members run until the trainer is at 3: partly stale, masked,
    # and the group trains whole (its advantages need both rewards).
    trainer = FakeTrainer()
    rollout = long_and_short({"t0"}, 3, trainer)
    settings = PoolSettings(batch_size=4, max_staleness=1, group_size=2, stale_policy="mask", stale_bound=2)
    pool, _ = run_pool(settings, rollout, trainer, steps=8, buffer=ReadyBuffer([], group_size=2))
    first = [t for _, batch, _, _ in trainer.batches for t in batch if t.task_id == "t0"]
    assert len(first) == 2 and all(t.num_action_tokens == 25 for t in first)
    assert pool.ledger.dropped_stale == 0 and pool.summary()["waste"]["masked"] == 50
    check_ledger(pool)


def test_the_config_chooses_the_policy_and_slack_beside_the_code():
    cfg = load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=1", "system.stale.policy=drop",
                                                   "system.stale.slack=0"])
    s = PoolSettings.from_config(cfg)
    assert (s.stale_policy, s.stale_bound) == ("drop", 1)
    # The defaults (issue 35): mask tokens more than max_staleness + 2 versions old, drain the end.
    s = PoolSettings.from_config(load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=2"]))
    assert (s.stale_policy, s.stale_bound, s.run_steps) == ("mask", 4, 60)
    # At staleness 0 the run is synchronous whatever the defaults: a trajectory with an older token
    # (over-provisioned admission) is dropped, never trained with slack.
    sync = PoolSettings.from_config(load_config("configs/kg_sao_tiny.yaml", ["system.admission=128"]))
    assert (sync.stale_policy, sync.stale_bound, sync.run_steps) == ("drop", 0, 60)
    with pytest.raises(ConfigError, match="system.stale.slack: is -1"):
        load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=2", "system.stale.slack=-1"])
    with pytest.raises(ConfigError, match="system.stale.bound was replaced by system.stale.slack.*slack=2"):
        load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=2", "system.stale.bound=4"])
    with pytest.raises(ConfigError, match="system.stale.policy: set to 'drop', but at system.max_staleness=0"):
        load_config("configs/kg_sao_tiny.yaml", ["system.stale.policy=drop"])
    with pytest.raises(ConfigError, match="'trim' is not one of 'drop', 'mask'"):
        load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=1", "system.stale.policy=trim"])


def test_the_simulator_masks_with_the_same_rule_and_accounts_for_every_token():
    heavy = Workload(Dist("const", 3), Dist("lognormal", 20, 0.5), Dist("lognormal", 1.0, 1.5, 30))
    one = Cluster(engines=1, engine_max_seqs=64, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                  train_step_s=1.0, sync_s=0.0)
    runs = {(p, k): simulate(heavy, one, Schedule(max_staleness=1, batch_size=16, steps=20, stale_policy=p,
                                                  stale_bound=k), seed=1)
            for p in ("drop", "mask") for k in (0, 2)}
    drop = runs["drop", 0]
    assert drop.dropped > 0 and drop.masked_tokens == 0
    for r in runs.values():
        assert r.trained == 16 * 20
        assert r.generated_tokens == r.trained_tokens + r.wasted_tokens  # every sampled token accounted for
    mask = runs["mask", 0]
    assert mask.masked_tokens > 0 and mask.dropped < drop.dropped
    assert mask.trained_length > drop.trained_length and mask.ks_d < drop.ks_d
    assert mask.tokens_per_trajectory == (mask.trained_tokens / mask.trained)
    assert runs["drop", 2].dropped < drop.dropped and runs["mask", 2].masked_tokens < mask.masked_tokens


def test_tiderl_simulate_compares_the_stale_policies(capsys):
    from tiderl.cli import _parser, main
    from tiderl.lab import simulate_cli

    args = _parser().parse_args(["simulate", "--batch-size", "4", "--steps", "4", "--seeds", "1", "--staleness", "1,2",
                                 "--cancel-factors", "none", "--stale-policies", "drop,mask,mask+1,mask+1/drain"])
    modes = {m.name: m.schedule for m in simulate_cli.modes_of(args, simulate_cli.settings(args)[2])}
    assert [n for n in modes if n.startswith("async")] == ["async-s1", "async-s2", "async-s1-mask", "async-s2-mask",
                                                           "async-s1-mask+1", "async-s2-mask+1",
                                                           "async-s1-mask+1-drain", "async-s2-mask+1-drain"]
    assert modes["async-s2-mask+1-drain"].drain and not modes["async-s2-mask+1"].drain
    assert (modes["async-s2-mask+1"].stale_policy, modes["async-s2-mask+1"].stale_bound) == ("mask", 3)
    assert (modes["async-s1-mask"].stale_bound, modes["async-s1"].stale_policy) == (0, "drop")
    assert main(["simulate", "--batch-size", "4", "--steps", "4", "--seeds", "1", "--staleness", "1",
                 "--cancel-factors", "none", "--stale-policies", "drop,mask+1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "len trained/finished" in next(line for line in lines if line.startswith("mode"))
    assert lines[-2].startswith("trained mean episode length / sync's (") and "async-s1-mask+1 waste" in lines[-2]
    with pytest.raises(SystemExit):
        main(["simulate", "--stale-policies", "mask+x"])
    with pytest.raises(SystemExit):
        main(["simulate", "--stale-policies", "mask+1/dry"])
    assert "argument --stale-policies" in capsys.readouterr().err


# --- draining the run's end (system.stale.drain) ----------------------------------------------------


def test_the_drain_rule_starts_only_what_the_steps_left_can_train():
    gate = StalenessGate(max_staleness=2, batch_size=2, run_steps=3)
    gate.started(4)  # version 0: 3 steps left can train 6, so 2 more may start
    assert gate.may_start(0, 0) and gate.may_start(0, 0, group_size=2) and not gate.may_start(0, 0, group_size=3)
    gate.started(2)
    assert gate.outstanding == 6 and gate.capacity == 6 and not gate.may_start(0, 0)
    gate.settled(2)  # the first step trained: version 1, 2 steps left for the 4 outstanding
    assert not gate.may_start(1, 1) and "fill the 2 steps left" in gate.blocker(1, 1)
    assert gate.may_start(1, 1, group_size=0)  # an attempt of a group already started: never held
    gate.settled(2)
    assert gate.may_start(1, 1, group_size=2) and not gate.may_start(3, 3)
    assert StalenessGate(max_staleness=2, batch_size=2).may_start(3, 3)  # no run length: no drain


@pytest.mark.parametrize("group_size", [1, 2])
def test_a_drained_run_ends_with_nothing_in_flight_or_buffered(group_size):
    # Episodes of varied lengths, staleness 2 with the mask policy: without the drain the run ends with
    # episodes started that no step trains (unsettled waste); with it every started attempt is trained.
    def run(drain: bool):
        trainer = FakeTrainer(lambda: 0.004)
        rollout = FakeRollout(lambda tid: 0.002 * (int(tid[1:]) % 5), length=lambda tid: 4 + int(tid[1:]) % 6)
        settings = PoolSettings(batch_size=4, max_staleness=2, group_size=group_size, stale_policy="mask",
                                stale_bound=3, run_steps=6 if drain else 0)
        pool, history = run_pool(settings, rollout, trainer, steps=6, buffer=ReadyBuffer([], group_size))
        check_ledger(pool)
        return pool, history

    open_pool, _ = run(False)
    assert open_pool.unsettled() > 0 and open_pool.summary()["waste"]["unsettled"] > 0
    drained, history = run(True)
    assert drained.unsettled() == 0 and drained.ledger.started == drained.ledger.trained == 24
    waste = drained.summary()["waste"]
    assert waste["unsettled"] == 0 and waste["wasted_tokens"] == waste["masked"]
    assert history[-1]["system/trained_action_tokens"] + waste["masked"] == drained.generated_tokens


def test_the_config_turns_the_drain_on_with_the_runs_step_count():
    cfg = load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=2", "train.steps=7"])
    assert PoolSettings.from_config(cfg).run_steps == 7  # on by default
    off = load_config("configs/kg_sao_tiny.yaml", ["system.max_staleness=2", "system.stale.drain=false"])
    assert PoolSettings.from_config(off).run_steps == 0


def test_the_simulator_drains_with_the_same_rule():
    heavy = Workload(Dist("const", 3), Dist("lognormal", 20, 0.5), Dist("lognormal", 1.0, 1.5, 30))
    one = Cluster(engines=1, engine_max_seqs=64, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                  train_step_s=1.0, sync_s=0.0)
    base = Schedule(max_staleness=2, batch_size=16, steps=20, stale_policy="mask", stale_bound=4)
    open_run, drained = (simulate(heavy, one, Schedule(**{**base.__dict__, "drain": d}), seed=1) for d in (False, True))
    for r in (open_run, drained):
        assert r.trained == 16 * 20 and r.generated_tokens == r.trained_tokens + r.wasted_tokens
    assert drained.wasted_tokens < open_run.wasted_tokens
    assert drained.wasted_tokens == drained.masked_tokens  # nothing left in flight or buffered at the end
    assert "drain" in Schedule(drain=True, max_staleness=1).label()
