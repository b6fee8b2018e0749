"""The algorithm extension points, by name: advantage estimators and policy losses, each with the
options dataclass it reads (`tiderl.algos.options`), and `AlgoConfig`, assembled from them.

This module imports no torch, so the config loader can check names and ask what an algorithm
needs (a critic, a reference model, groups of rollouts) or leaves unread without loading any
model code. The functions themselves are named by import path ("module:function") and imported
on first use.

Adding an estimator or a loss is one function with the uniform signature plus one name: a line
in the table below (with the options it reads, a dataclass among AlgoConfig's bases), or its
import path in the config, in which case the function may carry `needs_critic = True` /
`needs_groups = True` (docs/extending.md has an example of each).

The trainer (`tiderl.train.step.train_step`) looks the configured names up here and never
branches on `algo.name`, which is only the preset that filled in the options.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from tiderl.algos.options import ClipOptions, CriticOptions, DecoupledPPOOptions, GAEOptions, GRPOOptions
from tiderl.algos.options import OverlongOptions, PPOOptions, RegularizerOptions, TrainerOptions
from tiderl.options import need
from tiderl.registry import is_import_path, load_object


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: where its function lives, the options it reads, what it needs."""

    target: str  # "module:function", called as fn(AdvantageInputs, AlgoConfig) -> [N, T]
    options: type | None = None  # the algo.* options it reads (tiderl.algos.options)
    needs_critic: bool = False  # the step trains a critic and passes its values
    needs_groups: bool = False  # rollouts of one prompt share Trajectory.group_id


@dataclass(frozen=True)
class Loss:
    """A policy loss: fn(PolicyLossInputs, AlgoConfig) -> (token_loss [N, T], metrics), the options it reads."""

    target: str
    options: type = ClipOptions
    # Its token loss (and gradient) is exactly 0 where A_t = 0, so a trajectory whose advantages are
    # all 0 may be left out (`zero_advantage_rows_skippable`; an import-path loss opts in with the
    # attribute `zero_at_zero_advantage = True`).
    zero_at_zero_advantage: bool = True
    recomputes_old_logprobs: bool = False  # ratio against the recomputed log-probs whatever algo.old_logprobs says


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator("tiderl.algos.advantages:gae_advantages", GAEOptions, needs_critic=True),
    "grpo": Estimator("tiderl.algos.advantages:grpo_token_advantages", GRPOOptions, needs_groups=True),
    "dr_grpo": Estimator("tiderl.algos.advantages:dr_grpo_token_advantages", needs_groups=True),
    "rloo": Estimator("tiderl.algos.advantages:rloo_token_advantages", needs_groups=True),
    "reinforce_pp": Estimator("tiderl.algos.advantages:reinforce_pp_token_advantages"),
}

POLICY_LOSSES: dict[str, Loss] = {
    "dis": Loss("tiderl.algos.losses:dis_loss"),
    "ppo": Loss("tiderl.algos.losses:ppo_loss", PPOOptions),
    "decoupled_ppo": Loss("tiderl.algos.losses:decoupled_ppo_loss", DecoupledPPOOptions, recomputes_old_logprobs=True),
    "cispo": Loss("tiderl.algos.losses:cispo_loss"),
    "gspo": Loss("tiderl.algos.losses:gspo_loss"),
}


@dataclass
class AlgoConfig(OverlongOptions, RegularizerOptions, DecoupledPPOOptions, GRPOOptions, GAEOptions, CriticOptions,
                 TrainerOptions):
    """The RL algorithm (`algo.*`): the trainer's options, then the critic's, each estimator's and
    loss's, and the terms' (`tiderl.algos.options`), as one flat set of keys.

    `name` picks a preset (`tiderl.algos.presets`) that fills in the options; the trainer
    (`tiderl.train.step.train_step`) reads only those options, never the name.
    """

    def check(self, cfg: Any) -> None:
        """The choices' checks that need this registry, then each part's own."""
        for key, table in (("advantage", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
            value = getattr(self, key)
            need(value in table or is_import_path(value), key,
                 f"{value!r} is neither one of {', '.join(table)} nor a 'module:function' path",
                 f"use one of {', '.join(table)}")
        need(not uses_groups(self) or self.dynamic_sampling or self.group_size >= 2, "group_size",
             f"is {self.group_size}, but algo.advantage={self.advantage} compares rollouts of one prompt "
             "(a group of one has advantage 0)", "use e.g. 8, or algo.advantage=gae/reinforce_pp")
        need(needs_critic(self) or self.critic_warmup_steps == 0, "critic_warmup_steps",
             f"is {self.critic_warmup_steps} but algo.advantage={self.advantage} trains no critic, so the actor "
             "would not train for those steps", "set algo.critic_warmup_steps=0")
        for part in type(self).__mro__[1:]:
            if "check" in vars(part):
                vars(part)["check"](self, cfg)

    def unread(self, cfg: Any) -> dict[str, str]:
        """Option -> why nothing reads it: the options of the estimators and losses not chosen (an
        import-path choice may read any of its kind's) and the critic's without one, then what the
        chosen parts' own values turn off (their `unread`)."""
        parts = []  # (label, options, chosen, read)
        for kind, table in (("advantage", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
            choice = getattr(self, kind)
            parts += [(f"algo.{kind}={name}", entry.options, name == choice, name == choice or choice not in table)
                      for name, entry in table.items() if entry.options is not None]
        critic = needs_critic(self)
        parts.append(("a critic", CriticOptions, critic, critic))
        read = {key for _, options, _, reads in parts if reads for key in _keys(options)}
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            readers = [label for label, options, _, _ in parts if f.name in _keys(options)]
            if readers and f.name not in read:
                out[f.name] = (f"algo.advantage={self.advantage} trains no critic" if readers == ["a critic"] else
                               f"only {' and '.join(readers)} read{'s' if len(readers) == 1 else ''} it")
        for options in [options for _, options, chosen, _ in parts if chosen] + [RegularizerOptions, OverlongOptions]:
            if hasattr(options, "unread"):
                out = {**options.unread(self, cfg), **out}
        return out


def _keys(options: type) -> set[str]:
    return {f.name for f in dataclasses.fields(options)}


def estimator_spec(name: str) -> Estimator:
    """The Estimator for `algo.advantage`: a registered name, or an import path whose function
    may carry `needs_critic` / `needs_groups` attributes. Importing happens only for paths."""
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name]
    if is_import_path(name):
        fn = load_object(name, "algo.advantage")
        return Estimator(name, needs_critic=bool(getattr(fn, "needs_critic", False)),
                         needs_groups=bool(getattr(fn, "needs_groups", False)))
    raise KeyError(f"unknown advantage estimator {name!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)} "
                   "or a 'module:function' path")


def advantage_fn(name: str) -> Callable[..., Any]:
    """The estimator function `algo.advantage` names."""
    return load_object(estimator_spec(name).target, "algo.advantage")


def policy_loss_fn(name: str) -> Callable[..., Any]:
    """The token-loss function `algo.policy_loss` names (a registered name or an import path)."""
    if name in POLICY_LOSSES:
        return load_object(POLICY_LOSSES[name].target, "algo.policy_loss")
    if is_import_path(name):
        return load_object(name, "algo.policy_loss")
    raise KeyError(f"unknown policy loss {name!r}; use one of {', '.join(POLICY_LOSSES)} or a "
                   "'module:function' path")


# ---------------------------------------------------------------- what an algorithm config needs
# `algo` is an AlgoConfig (or anything with its fields).


def needs_critic(algo: Any) -> bool:
    """True when the step trains a critic (the advantage estimator reads values)."""
    return estimator_spec(algo.advantage).needs_critic


def needs_ref(algo: Any) -> bool:
    """True when the step needs a frozen reference model (a KL term, `kl_coef > 0`)."""
    return algo.kl_coef > 0


def uses_groups(algo: Any) -> bool:
    """True when the step reads `Trajectory.group_id` (group estimators, dynamic sampling)."""
    return estimator_spec(algo.advantage).needs_groups or bool(algo.dynamic_sampling)


def recomputes_old_logprobs(algo: Any) -> bool:
    """True when the step recomputes the log-probs the ratio is taken against."""
    loss = POLICY_LOSSES.get(algo.policy_loss)
    return (loss is not None and loss.recomputes_old_logprobs) or algo.old_logprobs == "recompute"


def zero_advantage_rows_skippable(algo: Any) -> bool:
    """True when a trajectory whose advantages are all 0 contributes exactly nothing to the actor's
    gradient: its policy loss vanishes at A = 0 (`Loss.zero_at_zero_advantage`, or an import-path
    loss with `zero_at_zero_advantage = True`), no KL term is in the loss, and no entropy bonus."""
    loss = POLICY_LOSSES.get(algo.policy_loss)
    if loss is not None:
        vanishes = loss.zero_at_zero_advantage
    else:
        vanishes = bool(getattr(policy_loss_fn(algo.policy_loss), "zero_at_zero_advantage", False))
    kl_in_loss = algo.kl_coef > 0 and not algo.kl_in_reward
    return vanishes and not kl_in_loss and algo.entropy_coef == 0
