"""Algorithms as pure tensor functions: advantage estimators, losses, aggregation, regularisers.

The trainer calls these with typed tensors and knows nothing about which algorithm runs;
presets choose the functions and their hyperparameters (`presets.py`), and `step.algo_step`
composes them into one optimizer step (docs/algorithms.md has every formula and its paper).

Names are imported lazily (PEP 562), so `tiderl.algos.presets` can be used by the config
loader without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "tiderl.algos.advantages": (
        "decoupled_policy_lambda", "explained_variance", "masked_mean", "masked_var",
        "masked_whiten", "outcome_token_rewards", "skip_observation_gae"),
    "tiderl.algos.losses": ("dis_policy_loss", "ppo_clip_policy_loss", "value_loss"),
    "tiderl.algos.aggregation": (
        "LOSS_AGG_MODES", "aggregate", "loss_normalizer", "sequence_mean", "token_weights"),
    "tiderl.algos.group_advantages": (
        "broadcast_to_tokens", "discounted_returns", "dr_grpo_advantages", "group_index_of",
        "grpo_advantages", "reinforce_pp_advantages", "rloo_advantages"),
    "tiderl.algos.policy_losses": (
        "cispo_token_loss", "decoupled_ppo_token_loss", "dis_token_loss", "gspo_token_loss",
        "ppo_token_loss", "sequence_ratio"),
    "tiderl.algos.regularizers": ("entropy_from_logits", "kl_estimate", "kl_reward_penalty"),
    "tiderl.algos.sampling": ("informative_groups", "overlong_penalty"),
    "tiderl.algos.presets": ("preset_defaults", "with_preset"),
    "tiderl.algos.step": ("algo_step", "group_size", "needs_critic", "needs_ref"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tiderl.algos' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
