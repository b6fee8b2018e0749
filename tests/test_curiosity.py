"""The curiosity-shaped reward against bonuses derived by hand (docs/curiosity.md).

Default kind weights used below: entity 0.5, entity_relation 1.0, table 0.5, column 1.0.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading

import pytest

from tiderl.rewards.curiosity import (
    CuriosityShaper,
    CuriosityConfig,
    anneal_weight,
    batch_metrics,
    curiosity_bonus,
    unit_kind,
    unit_weight,
)
from tiderl.types import Trajectory

M1 = "entity:m1"
M1_DIR = "entity_relation:m1|directed_by"
M1_ACT = "entity_relation:m1|starred_actors"
P7 = "entity:p7"


def settings(**kw) -> CuriosityConfig:
    return CuriosityConfig(**{"enabled": True, **kw})


def count(sh: CuriosityShaper, unit: str) -> int:
    """n(unit): the episodes the shaper has observed that touched `unit` (from its state)."""
    return sh.state_dict()["counts"].get(unit, 0)


def traj(units: list[str] | None, success: bool, reward: float | None = None,
         task_id: str = "t") -> Trajectory:
    """A one-token trajectory as an environment would close it."""
    r = (1.0 if success else 0.0) if reward is None else reward
    info: dict = {"success": 1.0 if success else 0.0}
    if units is not None:
        info["knowledge_units"] = sorted(units)
    return Trajectory(tokens=[5], loss_mask=[1], behavior_logprobs=[-0.1], policy_version=[0],
                      reward=r, reward_parts={"outcome": r}, task_id=task_id, env_info=info)


# ----------------------------------------------------------------------------- units and kinds


def test_unit_kind_is_the_text_before_the_first_colon() -> None:
    assert unit_kind("entity:m1") == "entity"
    assert unit_kind("entity_relation:m1|directed_by") == "entity_relation"
    assert unit_kind("column:films.year") == "column"
    assert unit_kind("entity_relation:a:b|r") == "entity_relation"  # only the first ':' splits
    assert unit_kind("no_colon") == ""


def test_kind_weights_and_default() -> None:
    s = settings(kind_weights={"entity": 0.25, "entity_relation": 2.0}, default_kind_weight=0.0,
                 weight=1.0)
    assert unit_weight("entity:a", s) == 0.25
    assert unit_weight("table:t", s) == 0.0  # not listed -> default 0.0
    # scope episode: 0.25 (entity) + 2.0 (entity_relation) + 0 (table) + 0 (no kind) = 2.25;
    # weight 1.0, cap 6 -> bonus 2.25
    units = ["entity:a", "entity_relation:a|r", "table:t", "weird"]
    bonus, d = curiosity_bonus(units, True, 0, {}, settings(
        kind_weights={"entity": 0.25, "entity_relation": 2.0}, default_kind_weight=0.0,
        weight=1.0, scope="episode"), base_reward=1.0)
    assert bonus == pytest.approx(2.25)
    assert d["curiosity/units"] == 4


# ----------------------------------------------------------------------------- scopes


def test_episode_scope_counts_distinct_units_and_ignores_history() -> None:
    sh = CuriosityShaper(settings(scope="episode", weight=0.05))
    # 0.5 (m1) + 1.0 (m1|directed_by) + 1.0 (m1|starred_actors) + 0.5 (p7) = 3.0; * 0.05 = 0.15.
    # M1 listed twice pays once.
    units = [M1, M1, M1_DIR, M1_ACT, P7]
    for _ in range(3):  # history does not matter in this scope
        bonus, d = sh.bonus(units, success=True, step=0, base_reward=1.0)
        assert bonus == pytest.approx(0.15)
        assert d["curiosity/units"] == 4
        sh.observe(units)
    assert count(sh, M1) == 3  # counted once per episode, not per mention


def test_global_scope_decays_as_one_over_sqrt_of_visits() -> None:
    sh = CuriosityShaper(settings(scope="global", weight=0.1))
    # episode 1, nothing seen: 0.5 * 1/sqrt(1) + 1.0 * 1/sqrt(1) = 1.5; * 0.1 = 0.15
    b1, d1 = sh.bonus([M1, M1_DIR], True, 0, base_reward=1.0)
    assert b1 == pytest.approx(0.15)
    assert d1["curiosity/novel_units"] == 2
    sh.observe([M1, M1_DIR])
    # episode 2: n(m1) = n(m1|dir) = 1, n(p7) = 0:
    # 0.5/sqrt(2) + 1.0/sqrt(2) + 0.5/sqrt(1) = 1.5/1.414214 + 0.5 = 1.060660 + 0.5 = 1.560660
    # * 0.1 = 0.1560660
    b2, d2 = sh.bonus([M1, M1_DIR, P7], True, 0, base_reward=1.0)
    assert b2 == pytest.approx(0.1560660, abs=1e-7)
    assert d2["curiosity/novel_units"] == 1 and d2["curiosity/units"] == 3
    sh.observe([M1, M1_DIR, P7])
    # episode 3: n(m1) = n(m1|dir) = 2: 1.5/sqrt(3) = 1.5/1.732051 = 0.866025; * 0.1 = 0.0866025
    b3, d3 = sh.bonus([M1, M1_DIR], True, 0, base_reward=1.0)
    assert b3 == pytest.approx(0.0866025, abs=1e-7)
    assert d3["curiosity/novel_units"] == 0


def test_both_scope_is_the_mean_of_episode_and_global() -> None:
    counts = {M1: 1, M1_DIR: 1}
    # m1:  0.5 * (1 + 1/sqrt(2))/2 = 0.5 * 0.853553 = 0.426777
    # dir: 1.0 * 0.853553 = 0.853553
    # p7:  0.5 * (1 + 1)/2 = 0.5
    # sum 1.780330; * 0.1 = 0.1780330
    bonus, _ = curiosity_bonus([M1, M1_DIR, P7], True, 0, counts,
                               settings(scope="both", weight=0.1), base_reward=1.0)
    assert bonus == pytest.approx(0.1780330, abs=1e-7)


def test_episode_cap_limits_the_novelty() -> None:
    s = settings(scope="episode", weight=0.05, episode_cap=4.0)
    ten = [f"column:t.c{i}" for i in range(10)]
    # 10 columns * 1.0 = 10 -> capped at 4; * 0.05 = 0.2
    bonus, d = curiosity_bonus(ten, True, 0, {}, s, base_reward=1.0)
    assert bonus == pytest.approx(0.2)
    assert d["curiosity/novelty"] == 4.0 and d["curiosity/units"] == 10
    # 3 columns = 3 < 4: uncapped; 3 * 0.05 = 0.15
    bonus, _ = curiosity_bonus(ten[:3], True, 0, {}, s, base_reward=1.0)
    assert bonus == pytest.approx(0.15)


# ----------------------------------------------------------------------------- annealing


def test_constant_schedule() -> None:
    s = settings(weight=0.1, final_weight=0.02, schedule="constant", anneal_steps=100)
    assert [anneal_weight(s, t) for t in (0, 50, 1000)] == [0.1, 0.1, 0.1]


def test_linear_schedule() -> None:
    s = settings(weight=0.1, final_weight=0.02, schedule="linear", anneal_steps=100)
    # w(t) = 0.1 + (0.02 - 0.1) * min(t/100, 1) = 0.1 - 0.08 p
    expected = {-5: 0.1, 0: 0.1, 25: 0.08, 50: 0.06, 100: 0.02, 250: 0.02}
    for t, w in expected.items():
        assert anneal_weight(s, t) == pytest.approx(w), t


def test_cosine_schedule() -> None:
    s = settings(weight=0.1, final_weight=0.02, schedule="cosine", anneal_steps=100)
    # w(t) = 0.02 + 0.08 * (1 + cos(pi p)) / 2
    # t=25: cos(pi/4) = 0.707107 -> 0.02 + 0.08 * 0.853553 = 0.02 + 0.068284 = 0.088284
    # t=75: cos(3pi/4) = -0.707107 -> 0.02 + 0.08 * 0.146447 = 0.02 + 0.011716 = 0.031716
    expected = {0: 0.1, 25: 0.088284, 50: 0.06, 75: 0.031716, 100: 0.02, 200: 0.02}
    for t, w in expected.items():
        assert anneal_weight(s, t) == pytest.approx(w, abs=1e-6), t


def test_annealed_weight_scales_the_bonus_and_disabled_pays_nothing() -> None:
    s = settings(scope="episode", weight=0.1, final_weight=0.02, schedule="linear",
                 anneal_steps=100)
    cols = ["column:t.a", "column:t.b"]
    # novelty 2.0; w(50) = 0.06 -> 0.12
    bonus, d = curiosity_bonus(cols, True, 50, {}, s, base_reward=1.0)
    assert bonus == pytest.approx(0.12) and d["curiosity/weight"] == pytest.approx(0.06)
    off = CuriosityConfig(enabled=False, scope="episode")
    bonus, d = curiosity_bonus(cols, True, 50, {}, off, base_reward=1.0)
    assert bonus == 0.0 and d["curiosity/units"] == 2 and d["curiosity/novel_units"] == 2


# ----------------------------------------------------------------------------- the gate


def test_gate_hand_values() -> None:
    s = settings(scope="episode", weight=1.0, gate_fraction=0.5, success_reward=1.0)
    cols = [f"column:t.c{i}" for i in range(4)]  # novelty 4.0, raw = 1.0 * 4.0 = 4.0
    # failed, r = 0: limit 0.5 * (1 - 0) = 0.5 -> 0.5, gated
    bonus, d = curiosity_bonus(cols, False, 0, {}, s, base_reward=0.0)
    assert (bonus, d["curiosity/raw_bonus"], d["curiosity/gated"]) == (0.5, 4.0, 1.0)
    # failed with partial credit r = 0.6: limit 0.5 * 0.4 = 0.2; total 0.8 < 1
    bonus, _ = curiosity_bonus(cols, False, 0, {}, s, base_reward=0.6)
    assert bonus == pytest.approx(0.2)
    # failed with r >= success_reward (the environment breaks the contract): pays nothing
    assert curiosity_bonus(cols, False, 0, {}, s, base_reward=1.2)[0] == 0.0
    # failed, raw below the limit: one column at weight 0.1 -> raw 0.1 < limit 0.5, paid in full
    bonus, d = curiosity_bonus(cols[:1], False, 0, {}, settings(scope="episode", weight=0.1))
    assert bonus == pytest.approx(0.1) and d["curiosity/gated"] == 0.0
    # successful: paid in full (4.0), not gated
    bonus, d = curiosity_bonus(cols, True, 0, {}, s, base_reward=1.0)
    assert (bonus, d["curiosity/gated"]) == (4.0, 0.0)
    # successful without pay_on_success: nothing, and that is not counted as gated
    s_off = settings(scope="episode", weight=1.0, pay_on_success=False)
    bonus, d = curiosity_bonus(cols, True, 0, {}, s_off, base_reward=1.0)
    assert (bonus, d["curiosity/gated"]) == (0.0, 0.0)


def test_gate_refuses_a_successful_episode_below_success_reward() -> None:
    with pytest.raises(ValueError, match="success_reward"):
        curiosity_bonus([M1], True, 0, {}, settings(), base_reward=0.5)


def test_gate_float_guard_when_the_headroom_rounds_away() -> None:
    # r = 1 - 2^-53 (the float just below 1). r + 0.9 * 2^-53 = 1 - 0.1 * 2^-53 rounds to 1.0,
    # which would tie a success, so the bonus must be 0.
    r = math.nextafter(1.0, 0.0)
    s = settings(scope="episode", weight=10.0, gate_fraction=0.9)
    assert r + 0.9 * (1.0 - r) == 1.0  # the rounding this guard exists for
    bonus, d = curiosity_bonus([M1], False, 0, {}, s, base_reward=r)
    assert bonus == 0.0 and d["curiosity/gated"] == 1.0
    assert r + bonus < 1.0


def _random_settings(rng: random.Random) -> CuriosityConfig:
    schedule = rng.choice(["constant", "linear", "cosine"])
    return CuriosityConfig(
        enabled=True,
        weight=rng.choice([0.0, rng.uniform(0, 0.2), rng.uniform(0, 50)]),
        final_weight=rng.uniform(0, 50),
        episode_cap=rng.uniform(0.01, 30),
        scope=rng.choice(["episode", "global", "both"]),
        kind_weights={k: rng.uniform(0, 10) for k in ("entity", "entity_relation", "table", "column")},
        default_kind_weight=rng.uniform(0, 10),
        schedule=schedule,
        anneal_steps=rng.randint(1, 500),
        pay_on_success=rng.random() < 0.7,
        success_reward=rng.choice([1.0, rng.uniform(-3, 3)]),
        gate_fraction=rng.choice([0.0, 0.5, math.nextafter(1.0, 0.0), rng.random() * 0.999999]),
    )


def _random_units(rng: random.Random) -> list[str]:
    kinds = ["entity", "entity_relation", "table", "column", "other"]
    return sorted({f"{rng.choice(kinds)}:u{rng.randint(0, 30)}" for _ in range(rng.randint(0, 25))})


def test_gate_property_failed_always_below_solved_randomised() -> None:
    """For every drawn input: total reward of a failed episode < that of a successful one.

    Failed rewards range over [S - 5, S), including the float just below S; successful rewards
    over [S, S + 3], including S itself. Each pair goes through `shape` on a shaper with random
    history, at a random step.
    """
    rng = random.Random(1234)
    for case in range(2000):
        s = _random_settings(rng)
        S = s.success_reward
        sh = CuriosityShaper(s)
        for _ in range(rng.randint(0, 5)):
            sh.observe(_random_units(rng))
        step = rng.randint(-10, 1000)
        r_fail = rng.choice([S - rng.uniform(0, 5), math.nextafter(S, -math.inf), S - 1e-12])
        r_win = rng.choice([S, S + rng.uniform(0, 3)])
        failed = sh.shape(traj(_random_units(rng), False, r_fail), step)
        solved = sh.shape(traj(_random_units(rng), True, r_win), step)
        assert failed.reward < solved.reward, (case, s, r_fail, failed.reward, solved.reward)
        assert failed.reward < S <= solved.reward
        assert failed.reward_parts["curiosity"] >= 0 and solved.reward_parts["curiosity"] >= 0


# ----------------------------------------------------------------------------- shape and metrics


def test_shape_adds_the_part_and_the_metrics_without_mutating_the_input() -> None:
    sh = CuriosityShaper(settings(scope="global", weight=0.1))
    t = traj([M1, M1_DIR], success=True)
    out = sh.shape(t, step=3)
    # 0.5 + 1.0 = 1.5 novel; * 0.1 = 0.15
    assert out.reward == pytest.approx(1.15)
    assert out.reward_parts == {"outcome": 1.0, "curiosity": pytest.approx(0.15)}
    assert out.env_info["curiosity/bonus"] == pytest.approx(0.15)
    assert out.env_info["curiosity/novel_units"] == 2
    assert out.env_info["knowledge_units"] == [M1, M1_DIR] and out.env_info["success"] == 1.0
    assert t.reward == 1.0 and "curiosity" not in t.reward_parts and "curiosity/bonus" not in t.env_info
    assert count(sh, M1) == 1 and sh.summary() == {"curiosity/seen_units": 2.0, "curiosity/episodes": 1.0}
    with pytest.raises(ValueError, match="once"):
        sh.shape(out, step=3)


def test_shape_without_units_pays_nothing_and_bad_units_are_named() -> None:
    sh = CuriosityShaper(settings())
    out = sh.shape(traj(None, success=False), step=0)
    assert out.reward == 0.0 and out.reward_parts["curiosity"] == 0.0
    assert out.env_info["curiosity/units"] == 0
    with pytest.raises(TypeError, match="knowledge_units"):
        bad = traj(None, success=False)
        bad.env_info["knowledge_units"] = "entity:m1"  # a string, not a list of strings
        sh.shape(bad, step=0)


def test_batch_metrics_hand_values() -> None:
    sh = CuriosityShaper(settings(scope="episode", weight=1.0, gate_fraction=0.5))
    a = sh.shape(traj([M1, M1_DIR], success=True), 0)    # 0.5 + 1.0 = 1.5 paid; 2 novel
    b = sh.shape(traj([M1, M1_DIR], success=False), 0)   # raw 1.5, gated to 0.5; 0 novel
    c = sh.shape(traj([], success=False), 0)             # nothing
    unshaped = traj([P7], success=False)                 # left out of the means
    m = batch_metrics([a, b, c, unshaped])
    assert m["curiosity/bonus"] == pytest.approx((1.5 + 0.5 + 0.0) / 3)
    assert m["curiosity/raw_bonus"] == pytest.approx((1.5 + 1.5 + 0.0) / 3)
    assert m["curiosity/novel_units"] == pytest.approx((2 + 0 + 0) / 3)
    assert m["curiosity/units"] == pytest.approx((2 + 2 + 0) / 3)
    assert m["curiosity/gated_frac"] == pytest.approx(1 / 3)
    assert batch_metrics([unshaped]) == {}


# ----------------------------------------------------------------------------- concurrency, state


@pytest.fixture
def fast_switching():
    # Switch threads as often as possible so a missing lock would show up as lost updates.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_concurrent_observe_counts_exactly(fast_switching) -> None:
    sh = CuriosityShaper(settings())
    threads, per_thread = 8, 500
    shared = [M1, M1_DIR, "column:t.c"]

    def work(i: int) -> None:
        for _ in range(per_thread):
            sh.observe(shared + [f"entity:own{i}"])

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for u in shared:
        assert count(sh, u) == threads * per_thread  # 8 * 500 = 4000
    for i in range(threads):
        assert count(sh, f"entity:own{i}") == per_thread
    assert sh.summary() == {"curiosity/seen_units": 3.0 + threads, "curiosity/episodes": 4000.0}


def test_concurrent_shape_makes_each_unit_novel_exactly_once(fast_switching) -> None:
    sh = CuriosityShaper(settings(scope="global"))
    pool = [f"entity_relation:e{i}|r" for i in range(60)]
    results: list[Trajectory] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine = [sh.shape(traj(rng.sample(pool, 5), rng.random() < 0.5), 0) for _ in range(150)]
        with lock:
            results.extend(mine)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    touched = {u for t in results for u in t.env_info["knowledge_units"]}
    # compute and observe are one step: a unit is never novel in two episodes
    assert sum(t.env_info["curiosity/novel_units"] for t in results) == len(touched)
    assert sum(count(sh, u) for u in touched) == 6 * 150 * 5


def test_state_round_trip_resumes_exactly() -> None:
    s = settings(scope="both", weight=0.1, schedule="cosine", final_weight=0.0, anneal_steps=50)
    rng = random.Random(7)
    history = [_random_units(rng) for _ in range(20)]
    future = [(_random_units(rng), rng.random() < 0.5) for _ in range(20)]
    a = CuriosityShaper(s)
    for units in history:
        a.observe(units)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = CuriosityShaper(s)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for step, (units, ok) in enumerate(future):
        ra = a.shape(traj(units, ok), step)
        rb = b.shape(traj(units, ok), step)
        assert ra.reward == rb.reward and ra.env_info == rb.env_info
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"version": 99, "counts": {}, "episodes": 0})


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"scope": "local"}, "scope"),
        ({"schedule": "exp"}, "schedule"),
        ({"gate_fraction": 1.0}, "gate_fraction"),
        ({"gate_fraction": -0.1}, "gate_fraction"),
        ({"schedule": "linear", "anneal_steps": 0}, "anneal_steps"),
        ({"kind_weights": {"entity": -1.0}}, "kind_weights.entity"),
        ({"episode_cap": 0.0}, "episode_cap"),
        ({"weight": -0.1}, "weight"),
        ({"success_reward": math.inf}, "success_reward"),
    ],
)
def test_bad_settings_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"curiosity.{field}"):
        CuriosityConfig(**kw)
