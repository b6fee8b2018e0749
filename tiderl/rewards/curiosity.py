"""The curiosity-shaped reward: a bonus for touching knowledge, gated below solving.

tiderl's own documented design (KARL's exact formula is not public): docs/curiosity.md gives the
formula, the units an environment reports in `env_info["knowledge_units"]` (`"<kind>:<name>"`),
and the proof that exploring never pays more than solving (the gate keeps a failed episode's total
below `success_reward`). The math is pure functions over (settings, step, counts);
`CuriosityShaper` only adds the thread-safe global counts and a checkpointable state.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiderl.options import opt
from tiderl.types import Trajectory

SCOPES = ("episode", "global", "both")
SCHEDULES = ("constant", "linear", "cosine")

# The env_info key the environments fill (a sorted list of unit strings).
UNITS_KEY = "knowledge_units"
# The reward part this module adds.
PART = "curiosity"

# Per-episode metrics, recorded in env_info under these names; `batch_metrics` averages them.
M_BONUS = "curiosity/bonus"
M_RAW = "curiosity/raw_bonus"
M_NOVELTY = "curiosity/novelty"
M_UNITS = "curiosity/units"
M_NOVEL = "curiosity/novel_units"
M_WEIGHT = "curiosity/weight"
M_GATED = "curiosity/gated"

STATE_VERSION = 1


@dataclass
class CuriosityConfig:
    """The `curiosity:` config section (config.py holds it); `docs/curiosity.md` states the formula
    in full. Values are checked on construction (ValueError naming `curiosity.<field>` and the fix)."""

    enabled: bool = opt(
        False,
        "Pay the curiosity bonus. When false the bonus is 0, but the units are still counted and "
        "the curiosity metrics still logged, so a run without the bonus shows how it explores.",
    )
    weight: float = opt(
        0.05, "Reward per unit of novelty at step 0 (one fully novel unit of kind weight 1)."
    )
    episode_cap: float = opt(
        6.0,
        "Most novelty one episode can earn, in novelty units (before the weight): the bonus is "
        "at most weight(t) * episode_cap.",
    )
    scope: str = opt(
        "global",
        "'episode': every distinct unit of the episode counts 1; 'global': a unit counts "
        "1/sqrt(1 + n) with n the earlier episodes that touched it; 'both': the mean of the two.",
        SCOPES,
    )
    kind_weights: dict[str, float] = opt(
        {"entity": 0.5, "entity_relation": 1.0, "table": 0.5, "column": 1.0},
        "Weight of a unit by its kind (the text before the first ':'): a relation followed from "
        "an entity or a column read is worth more than a bare entity or table.",
    )
    default_kind_weight: float = opt(1.0, "Weight of a unit whose kind is not in kind_weights.")
    schedule: str = opt(
        "constant",
        "Annealing of the weight over training steps: 'constant' keeps `weight`; 'linear' and "
        "'cosine' move it to `final_weight` over `anneal_steps` steps, then hold it.",
        SCHEDULES,
    )
    final_weight: float = opt(0.0, "Weight reached at `anneal_steps` (linear, cosine).")
    anneal_steps: int = opt(0, "Steps over which the weight anneals (>= 1 for linear, cosine).")
    pay_on_success: bool = opt(
        True,
        "Pay the bonus on successful episodes too. Then the same exploration adds the same "
        "bonus whether the episode succeeds or fails, so the bonus never narrows the gap "
        "between solving and failing; false pays only failed episodes.",
    )
    success_reward: float = opt(
        1.0,
        "The lowest reward (before curiosity) of any successful episode. A successful episode "
        "below it is an error: the gate could not hold.",
    )
    gate_fraction: float = opt(
        0.5,
        "A failed episode with reward r earns at most gate_fraction * (success_reward - r), so "
        "its total stays strictly below success_reward. In [0, 1).",
    )

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, problem: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"curiosity.{name}: {problem}. Fix: {fix}.")

        def finite(x: float) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        need(self.scope in SCOPES, "scope", f"{self.scope!r} is not one of {SCOPES}", "use 'global'")
        need(self.schedule in SCHEDULES, "schedule", f"{self.schedule!r} is not one of {SCHEDULES}",
             "use 'constant', 'linear' or 'cosine'")
        need(finite(self.weight) and self.weight >= 0, "weight", f"{self.weight} must be >= 0",
             "use e.g. 0.05")
        need(finite(self.final_weight) and self.final_weight >= 0, "final_weight",
             f"{self.final_weight} must be >= 0", "use e.g. 0.0")
        need(finite(self.episode_cap) and self.episode_cap > 0, "episode_cap",
             f"{self.episode_cap} must be > 0", "use e.g. 6.0")
        need(isinstance(self.anneal_steps, int) and self.anneal_steps >= 0, "anneal_steps",
             f"{self.anneal_steps} must be an integer >= 0", "use e.g. 500")
        need(self.schedule == "constant" or self.anneal_steps >= 1, "anneal_steps",
             f"schedule {self.schedule!r} needs anneal_steps >= 1, got {self.anneal_steps}",
             "set anneal_steps to the steps the weight should take to reach final_weight")
        for kind, w in self.kind_weights.items():
            need(finite(w) and w >= 0, f"kind_weights.{kind}", f"{w} must be a number >= 0",
                 "use e.g. 1.0")
        need(finite(self.default_kind_weight) and self.default_kind_weight >= 0,
             "default_kind_weight", f"{self.default_kind_weight} must be >= 0", "use 1.0")
        need(finite(self.success_reward), "success_reward", f"{self.success_reward} is not finite",
             "use the outcome reward of a solved task, e.g. 1.0")
        need(finite(self.gate_fraction) and 0 <= self.gate_fraction < 1, "gate_fraction",
             f"{self.gate_fraction} is outside [0, 1)", "use e.g. 0.5")


# ----------------------------------------------------------------------------- pure math


def unit_kind(unit: str) -> str:
    """The kind of a unit: the text before its first ':' ('' when it has none)."""
    kind, sep, _ = unit.partition(":")
    return kind if sep else ""


def unit_weight(unit: str, settings: CuriosityConfig) -> float:
    """kind_weights[kind(unit)], or default_kind_weight for a kind not listed."""
    return settings.kind_weights.get(unit_kind(unit), settings.default_kind_weight)


def unit_novelty(n_seen: int, scope: str) -> float:
    """nu for a unit that `n_seen` earlier episodes touched: 1 ("episode"),
    1/sqrt(1 + n_seen) ("global"), or the mean of the two ("both")."""
    # 1 + n_seen, not n_seen: the first visit pays 1 instead of dividing by zero.
    count_based = 1.0 / math.sqrt(1 + n_seen)
    if scope == "episode":
        return 1.0
    if scope == "global":
        return count_based
    if scope == "both":
        return 0.5 * (1.0 + count_based)
    raise ValueError(f"unknown curiosity scope {scope!r}; use one of {SCOPES}")


def anneal_weight(settings: CuriosityConfig, step: int) -> float:
    """weight(t), with p = min(max(t, 0) / anneal_steps, 1), w0 = weight, w1 = final_weight:

    constant: w0;  linear: w0 + (w1 - w0) * p;  cosine: w1 + (w0 - w1) * (1 + cos(pi p)) / 2.
    0 when the bonus is disabled.
    """
    if not settings.enabled:
        return 0.0
    w0, w1 = settings.weight, settings.final_weight
    if settings.schedule == "constant":
        return w0
    p = min(max(step, 0) / settings.anneal_steps, 1.0)
    if settings.schedule == "linear":
        return w0 + (w1 - w0) * p
    return w1 + (w0 - w1) * 0.5 * (1.0 + math.cos(math.pi * p))


def gate_limit(success: bool, base_reward: float, settings: CuriosityConfig) -> float:
    """The most bonus an episode may receive: inf for a successful episode (0 when
    pay_on_success is false), gate_fraction * max(0, success_reward - r) for a failed one."""
    if success:
        return math.inf if settings.pay_on_success else 0.0
    return settings.gate_fraction * max(0.0, settings.success_reward - base_reward)


def distinct_units(units: Iterable[str]) -> list[str]:
    """The episode's distinct units, sorted; the contract promises a sorted list of strings, but
    a repeated unit must not pay twice, so it is de-duplicated here anyway."""
    if isinstance(units, str):
        # A bare string would iterate as characters: a contract violation worth naming.
        raise TypeError(f"{UNITS_KEY} must be a list of strings, got the string {units!r}")
    out = set()
    for u in units:
        if not isinstance(u, str):
            raise TypeError(f"{UNITS_KEY} must hold strings like 'entity:<id>', got {u!r}")
        out.add(u)
    return sorted(out)


def curiosity_bonus(
    units: Iterable[str],
    success: bool,
    step: int,
    counts: Mapping[str, int],
    settings: CuriosityConfig,
    base_reward: float = 0.0,
) -> tuple[float, dict[str, float]]:
    """The bonus of one episode and its details; pure (reads `counts`, changes nothing).

    units: the episode's knowledge units; success: whether the environment scored it solved;
    step: the training step t for annealing; counts: n(u), earlier episodes per unit;
    base_reward: the episode's reward r before curiosity (the gate's headroom).

    Returns (bonus, details) with details keyed by the metric names: the bonus, the raw
    (ungated) bonus, the capped novelty, the distinct and the never-seen units, weight(t), and
    gated = 1.0 when the episode failed and the gate cut its bonus below the raw bonus.
    """
    if success and base_reward < settings.success_reward:
        raise ValueError(
            f"a successful episode has reward {base_reward} < curiosity success_reward "
            f"{settings.success_reward}: the gate (failed < solved) could not hold. Fix: set "
            "success_reward to the lowest reward a successful episode can get."
        )
    distinct = distinct_units(units)
    weighted = sum(unit_weight(u, settings) * unit_novelty(counts.get(u, 0), settings.scope)
                   for u in distinct)
    novelty = min(settings.episode_cap, weighted)
    weight = anneal_weight(settings, step)
    raw = weight * novelty
    bonus = min(raw, gate_limit(success, base_reward, settings))
    if not success and bonus > 0 and base_reward + bonus >= settings.success_reward:
        # Only floating-point rounding of r + g * (S - r) with S - r tiny can land here;
        # paying nothing keeps the failed total r strictly below S.
        bonus = 0.0
    details = {
        M_BONUS: bonus,
        M_RAW: raw,
        M_NOVELTY: novelty,
        M_UNITS: float(len(distinct)),
        M_NOVEL: float(sum(1 for u in distinct if counts.get(u, 0) == 0)),
        M_WEIGHT: weight,
        # "Gated" means the failure gate cut the bonus; pay_on_success = false is a choice, not a cut.
        M_GATED: 1.0 if not success and bonus < raw else 0.0,
    }
    return bonus, details


def batch_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-batch means of the shaped trajectories' curiosity metrics (docs/curiosity.md), with
    curiosity/gated_frac, the fraction of episodes whose bonus the gate cut. Trajectories that
    were not shaped are left out; an empty dict when none was."""
    shaped = [t.env_info for t in trajectories if M_BONUS in t.env_info]
    if not shaped:
        return {}
    n = len(shaped)
    out = {k: sum(float(info[k]) for info in shaped) / n
           for k in (M_BONUS, M_RAW, M_NOVELTY, M_UNITS, M_NOVEL, M_WEIGHT)}
    out["curiosity/gated_frac"] = sum(float(info[M_GATED]) for info in shaped) / n
    return out


# ----------------------------------------------------------------------------- state


class CuriosityShaper:
    """Applies the curiosity bonus and owns the global counts n(u).

    Rollouts finish concurrently, so every read and write of the counts holds one lock, and
    `shape` computes and observes under that lock in one piece: each episode sees exactly the
    episodes shaped before it, and a unit is "novel" in exactly one episode.
    """

    def __init__(self, settings: CuriosityConfig | None = None) -> None:
        self.settings = settings or CuriosityConfig()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._episodes = 0

    def bonus(self, units: Iterable[str], success: bool, step: int,
              base_reward: float = 0.0) -> tuple[float, dict[str, float]]:
        """`curiosity_bonus` against the current counts; changes nothing (call `observe` after)."""
        with self._lock:
            return curiosity_bonus(units, success, step, self._counts, self.settings, base_reward)

    def observe(self, units: Iterable[str]) -> None:
        """Count one episode: n(u) += 1 for each distinct unit it touched."""
        units = distinct_units(units)
        with self._lock:
            self._observe_locked(units)

    def _observe_locked(self, units: list[str]) -> None:
        for u in units:
            self._counts[u] = self._counts.get(u, 0) + 1
        self._episodes += 1

    def shape(self, trajectory: Trajectory, step: int) -> Trajectory:
        """A copy of `trajectory` with reward_parts["curiosity"] = bonus, reward += bonus and the
        per-episode metrics in env_info; the episode's units are then counted.

        The per-token lists are shared with the input, not copied (they do not change). Shaping
        the same trajectory twice is refused: it would pay and count it twice.
        """
        if PART in trajectory.reward_parts:
            raise ValueError(
                f"trajectory {trajectory.task_id!r} already has a '{PART}' reward part: shape "
                "each trajectory once"
            )
        units = distinct_units(trajectory.env_info.get(UNITS_KEY) or [])  # none: e.g. an episode that failed
        success = bool(trajectory.env_info.get("success", 0))  # environments report 0.0 / 1.0
        with self._lock:
            bonus, details = curiosity_bonus(units, success, step, self._counts, self.settings,
                                             trajectory.reward)
            self._observe_locked(units)
        return dataclasses.replace(
            trajectory,
            reward=trajectory.reward + bonus,
            reward_parts={**trajectory.reward_parts, PART: bonus},
            env_info={**trajectory.env_info, **details},
        )

    def summary(self) -> dict[str, float]:
        """Run-level numbers: curiosity/seen_units (distinct units ever touched) and
        curiosity/episodes (episodes observed)."""
        with self._lock:
            return {"curiosity/seen_units": float(len(self._counts)),
                    "curiosity/episodes": float(self._episodes)}

    def state_dict(self) -> dict[str, Any]:
        """The counts, as plain JSON-compatible data (checkpoint it with the trainer's state)."""
        with self._lock:
            return {"version": STATE_VERSION, "counts": dict(self._counts),
                    "episodes": self._episodes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the counts with a `state_dict`'s, so a resumed run pays exactly as the
        original would have."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"curiosity state has version {state.get('version')!r}, expected {STATE_VERSION}: "
                "it was written by another tiderl version"
            )
        counts = {str(u): int(n) for u, n in state["counts"].items()}
        if any(n < 1 for n in counts.values()):
            raise ValueError("curiosity state holds a unit counted < 1 times: it is corrupt")
        episodes = int(state["episodes"])
        with self._lock:
            self._counts = counts
            self._episodes = episodes
