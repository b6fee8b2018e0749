"""Reward shaping on finished trajectories (the outcome reward belongs to each environment)."""

from tiderl.rewards.curiosity import (
    CuriosityShaper,
    CuriosityConfig,
    anneal_weight,
    batch_metrics,
    curiosity_bonus,
)

__all__ = [
    "CuriosityShaper",
    "CuriosityConfig",
    "anneal_weight",
    "batch_metrics",
    "curiosity_bonus",
]
