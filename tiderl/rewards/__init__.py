"""Reward shaping on finished trajectories (the outcome reward belongs to each environment)."""

from tiderl.rewards.curiosity import (
    CuriosityShaper,
    CuriositySettings,
    anneal_weight,
    batch_metrics,
    curiosity_bonus,
)

__all__ = [
    "CuriosityShaper",
    "CuriositySettings",
    "anneal_weight",
    "batch_metrics",
    "curiosity_bonus",
]
