"""Algorithms as pure tensor functions: advantage estimators, losses, aggregation, regularisers.

The trainer (`tiderl.train.step.train_step`) calls these with typed tensors and knows nothing
about which algorithm runs: `registry.py` maps the configured names (`algo.advantage`,
`algo.policy_loss`) to functions, and presets choose the names and their hyperparameters
(`presets.py`). docs/algorithms.md has every formula and its paper. Nothing here imports the
trainer, the config loader or the system.

Names are imported lazily (PEP 562), so `tiderl.algos.presets` and `tiderl.algos.registry` can
be used by the config loader without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "tiderl.algos.advantages": (
        "AdvantageInputs", "broadcast_to_tokens", "decoupled_policy_lambda", "discounted_returns",
        "dr_grpo_advantages", "explained_variance", "group_index_of", "grpo_advantages",
        "masked_mean", "masked_var", "masked_whiten", "outcome_token_rewards",
        "reinforce_pp_advantages", "rloo_advantages", "skip_observation_gae"),
    "tiderl.algos.losses": (
        "PolicyLossInputs", "cispo_token_loss", "decoupled_ppo_token_loss", "dis_token_loss",
        "gspo_token_loss", "ppo_token_loss", "sequence_ratio", "value_loss"),
    "tiderl.algos.aggregation": (
        "LOSS_AGG_MODES", "aggregate", "loss_normalizer", "sequence_mean", "token_weights"),
    "tiderl.algos.regularizers": ("entropy_from_logits", "kl_estimate", "kl_reward_penalty"),
    "tiderl.algos.sampling": ("informative_groups", "overlong_penalty"),
    "tiderl.algos.presets": ("PRESETS", "TRAINER_KEYS"),
    "tiderl.algos.registry": (
        "advantage_fn", "group_size", "needs_critic", "needs_ref", "policy_loss_fn",
        "recomputes_old_logprobs", "uses_groups"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tiderl.algos' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
