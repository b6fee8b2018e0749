"""The algorithm extension points, by name: advantage estimators and policy losses.

This module imports no torch, so the config loader can check names and ask what an algorithm
needs (a critic, a reference model, groups of rollouts) without loading any model code. The
functions themselves are named by import path ("module:function") and imported on first use.

Adding an estimator or a loss is one function plus one name:

- write the function with the uniform signature (`tiderl.algos.advantages.AdvantageInputs` or
  `tiderl.algos.losses.PolicyLossInputs`, plus the `AlgoConfig`), in any module;
- add a line to the table below (a built-in), or write the import path itself in the config
  (`algo.advantage: mypkg.adv:my_estimator`), in which case the function may carry
  `needs_critic = True` / `needs_groups = True` as attributes.

The trainer (`tiderl.train.step.train_step`) looks the configured names up here and never
branches on `algo.name`, which is only the preset that filled in the options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tiderl.registry import is_import_path, load_object


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: where its function lives and what it needs from the run."""

    target: str  # "module:function", called as fn(AdvantageInputs, AlgoConfig) -> [N, T]
    needs_critic: bool = False  # the step trains a critic and passes its values
    needs_groups: bool = False  # rollouts of one prompt share Trajectory.group_id


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator("tiderl.algos.advantages:gae_advantages", needs_critic=True),
    "grpo": Estimator("tiderl.algos.advantages:grpo_token_advantages", needs_groups=True),
    "dr_grpo": Estimator("tiderl.algos.advantages:dr_grpo_token_advantages", needs_groups=True),
    "rloo": Estimator("tiderl.algos.advantages:rloo_token_advantages", needs_groups=True),
    "reinforce_pp": Estimator("tiderl.algos.advantages:reinforce_pp_token_advantages"),
}

# Each called as fn(PolicyLossInputs, AlgoConfig) -> (token_loss [N, T], metrics).
POLICY_LOSSES: dict[str, str] = {
    "dis": "tiderl.algos.losses:dis_loss",
    "ppo": "tiderl.algos.losses:ppo_loss",
    "decoupled_ppo": "tiderl.algos.losses:decoupled_ppo_loss",
    "cispo": "tiderl.algos.losses:cispo_loss",
    "gspo": "tiderl.algos.losses:gspo_loss",
}

# Losses whose token loss, and so its gradient, is exactly 0 on a token whose advantage is 0
# (every term is multiplied by A_t): the trainer may leave out a trajectory whose advantages are
# all 0 without changing the update (`zero_advantage_rows_skippable`). An import-path loss opts
# in with the attribute `zero_at_zero_advantage = True`.
ZERO_AT_ZERO_ADVANTAGE = ("dis", "ppo", "decoupled_ppo", "cispo", "gspo")

# Losses whose ratio is taken against the trainer's recomputed (proximal) log-probs whatever
# `algo.old_logprobs` says.
RECOMPUTES_OLD_LOGPROBS = ("decoupled_ppo",)


def estimator_spec(name: str) -> Estimator:
    """The Estimator for `algo.advantage`: a registered name, or an import path whose function
    may carry `needs_critic` / `needs_groups` attributes. Importing happens only for paths."""
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name]
    if is_import_path(name):
        fn = load_object(name, "algo.advantage")
        return Estimator(name, bool(getattr(fn, "needs_critic", False)), bool(getattr(fn, "needs_groups", False)))
    raise KeyError(f"unknown advantage estimator {name!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)} "
                   "or a 'module:function' path")


def advantage_fn(name: str) -> Callable[..., Any]:
    """The estimator function `algo.advantage` names."""
    return load_object(estimator_spec(name).target, "algo.advantage")


def policy_loss_fn(name: str) -> Callable[..., Any]:
    """The token-loss function `algo.policy_loss` names (a registered name or an import path)."""
    if name in POLICY_LOSSES:
        return load_object(POLICY_LOSSES[name], "algo.policy_loss")
    if is_import_path(name):
        return load_object(name, "algo.policy_loss")
    raise KeyError(f"unknown policy loss {name!r}; use one of {', '.join(POLICY_LOSSES)} or a "
                   "'module:function' path")


# ---------------------------------------------------------------- what an algorithm config needs
# `algo` is an AlgoConfig (duck-typed here to keep this module free of tiderl.config).


def needs_critic(algo: Any) -> bool:
    """True when the step trains a critic (the advantage estimator reads values)."""
    return estimator_spec(algo.advantage).needs_critic


def needs_ref(algo: Any) -> bool:
    """True when the step needs a frozen reference model (a KL term, `kl_coef > 0`)."""
    return algo.kl_coef > 0


def uses_groups(algo: Any) -> bool:
    """True when the step reads `Trajectory.group_id` (group estimators, dynamic sampling)."""
    return estimator_spec(algo.advantage).needs_groups or bool(algo.dynamic_sampling)


def group_size(algo: Any) -> int:
    """Rollouts sampled per prompt (they share a group_id)."""
    return int(algo.group_size)


def recomputes_old_logprobs(algo: Any) -> bool:
    """True when the step recomputes the log-probs the ratio is taken against."""
    return algo.policy_loss in RECOMPUTES_OLD_LOGPROBS or algo.old_logprobs == "recompute"


def zero_advantage_rows_skippable(algo: Any) -> bool:
    """True when a trajectory whose advantages are all 0 contributes exactly nothing to the actor's
    gradient: its policy loss vanishes at A = 0 (`ZERO_AT_ZERO_ADVANTAGE`, or an import-path loss
    with `zero_at_zero_advantage = True`), no KL term is in the loss, and no entropy bonus."""
    name = algo.policy_loss
    if name in POLICY_LOSSES:
        vanishes = name in ZERO_AT_ZERO_ADVANTAGE
    else:
        vanishes = bool(getattr(policy_loss_fn(name), "zero_at_zero_advantage", False))
    kl_in_loss = algo.kl_coef > 0 and not algo.kl_in_reward
    return vanishes and not kl_in_loss and algo.entropy_coef == 0
