"""Algorithms as pure tensor functions: advantage estimators and losses.

The trainer calls these with typed tensors and knows nothing about which algorithm runs;
presets choose the functions and their hyperparameters.
"""

from tiderl.algos.advantages import (
    decoupled_policy_lambda,
    explained_variance,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_token_rewards,
    skip_observation_gae,
)
from tiderl.algos.losses import dis_policy_loss, ppo_clip_policy_loss, value_loss

__all__ = [
    "decoupled_policy_lambda",
    "dis_policy_loss",
    "explained_variance",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "outcome_token_rewards",
    "ppo_clip_policy_loss",
    "skip_observation_gae",
    "value_loss",
]
