"""The algorithm extension points, by name: advantage estimators and policy losses.

This module imports no torch, so the config loader can check names and ask what an algorithm
needs (a critic, a reference model, groups of rollouts) without loading any model code. The
functions themselves are named by import path ("module:function") and imported on first use.

Adding an estimator or a loss is one function plus one name:

- write the function with the uniform signature (`tiderl.algos.advantages.AdvantageInputs` or
  `tiderl.algos.losses.PolicyLossInputs`, plus the `AlgoConfig`), in any module;
- either add a line to the table below (built-ins), or call `register_advantage` /
  `register_policy_loss` from your own code before the config loads, or write the import
  path itself in the config (`algo.advantage: mypkg.adv:my_estimator`), in which case the
  function may carry `needs_critic = True` / `needs_groups = True` as attributes.

The trainer (`tiderl.train.step.train_step`) looks the configured names up here and never
branches on `algo.name`, which is only the preset that filled in the options.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


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

# Losses whose ratio is taken against the trainer's recomputed (proximal) log-probs whatever
# `algo.old_logprobs` says.
RECOMPUTES_OLD_LOGPROBS = ("decoupled_ppo",)


def register_advantage(name: str, estimator: Estimator) -> None:
    """Make `algo.advantage: <name>` mean `estimator` (built-in names cannot be replaced)."""
    _register(ADVANTAGE_ESTIMATORS, name, estimator, "advantage estimator")


def register_policy_loss(name: str, target: str) -> None:
    """Make `algo.policy_loss: <name>` mean the function at `target` ("module:function")."""
    _register(POLICY_LOSSES, name, target, "policy loss")


def _register(table: dict[str, Any], name: str, value: Any, what: str) -> None:
    if name in table and table[name] != value:
        raise ValueError(f"{what} {name!r} is already registered as {table[name]!r}")
    table[name] = value


def is_import_path(name: str) -> bool:
    """True for "module:attribute" strings (a user's own function or class)."""
    module, _, attr = name.partition(":")
    return bool(module) and bool(attr) and all(p.isidentifier() for p in module.split(".") + attr.split("."))


def load_object(target: str, what: str = "object") -> Any:
    """The object an import path "module:attr.sub" names; ImportError/AttributeError say which
    part is missing and how to fix it."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what} {target!r}: cannot import module {module_name!r} ({exc}). Fix: make it "
                          "importable (installed, or on PYTHONPATH) or correct the name.") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{what} {target!r}: module {module_name!r} has no {attr!r}. Fix: "
                                 "name a function or class that the module defines.")
        obj = getattr(obj, part)
    return obj


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
