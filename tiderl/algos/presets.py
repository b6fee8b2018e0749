"""Algorithm presets: what `algo.name` means, as defaults for the algorithm options.

Each preset lists only what differs from SAO (the AlgoConfig defaults). The config loader applies
them (`tiderl.config.preset_defaults` / `with_preset`): a preset gives a value to EVERY algorithm
option, so switching from one preset to another leaves nothing of the previous algorithm behind;
it never sets a trainer option (TRAINER_KEYS: learning rates, critic initialisation and freezing):
a preset changes what is optimised, not how the optimiser runs. The keys a user writes win.

Values come from each algorithm's paper where we know them (docs/algorithms.md gives the sources)
and are marked "ours" there where the paper is silent or its value does not fit (e.g. group
sizes are chosen to divide the default 32-trajectory batch).
"""

from __future__ import annotations

from typing import Any

# Plain tables: the config loader imports them, so nothing here imports tiderl.config or torch.

__all__ = ["PRESETS", "TRAINER_KEYS"]

# AlgoConfig fields that are trainer options: presets never touch them.
TRAINER_KEYS = ("actor_lr", "critic_lr", "value_init", "freeze_critic_attention",
                "critic_freeze_pattern")


_CRITIC_FREE = {"critic_warmup_steps": 0}  # no critic to warm up: train the actor from step 0

# Each preset lists only what differs from SAO (the AlgoConfig defaults).
PRESETS: dict[str, dict[str, Any]] = {
    # SAO, arXiv 2607.07508: single rollout, critic + skip-observation GAE with decoupled lambda,
    # K = 2 critic updates, DIS band (0.3, 5.0), no KL, no entropy.
    "sao": {},
    # PPO (Schulman et al. 2017) with a critic and fixed-lambda GAE, ratio against the sampling
    # policy, advantages whitened per batch.
    "ppo": {"advantage": "gae", "decoupled_lambda": False, "policy_lambda": 0.95,
            "critic_lambda": 0.95, "critic_updates": 1, "critic_warmup_steps": 0,
            "policy_loss": "ppo", "eps_low": 0.2, "eps_high": 0.2, "normalize_advantages": True},
    # GRPO (DeepSeekMath): group-normalised outcome advantages, PPO clip 0.2, per-sequence token
    # mean, KL to the reference in the loss with k3 and beta 0.04.
    "grpo": {**_CRITIC_FREE, "advantage": "grpo", "group_size": 8, "policy_loss": "ppo",
             "eps_low": 0.2, "eps_high": 0.2, "loss_agg": "seq-mean-token-mean",
             "kl_coef": 0.04, "kl_estimator": "k3"},
    # Dr.GRPO: no std division, no per-response length normalisation, no KL.
    "dr_grpo": {**_CRITIC_FREE, "advantage": "dr_grpo", "group_size": 8, "policy_loss": "ppo",
                "eps_low": 0.2, "eps_high": 0.2, "loss_agg": "seq-mean-token-sum"},
    # DAPO: clip-higher (0.2, 0.28), dynamic sampling, token-level loss, no KL; its overlong
    # shaping needs the run's length limit, so it is left to algo.overlong_* (off here).
    "dapo": {**_CRITIC_FREE, "advantage": "grpo", "group_size": 16, "policy_loss": "ppo",
             "eps_low": 0.2, "eps_high": 0.28, "loss_agg": "token-mean",
             "dynamic_sampling": True},
    # GSPO: sequence-level ratio and clip (3e-4, 4e-4), group-normalised advantages,
    # mean over sequences.
    "gspo": {**_CRITIC_FREE, "advantage": "grpo", "group_size": 8, "policy_loss": "gspo",
             "eps_low": 3e-4, "eps_high": 4e-4, "loss_agg": "seq-mean-token-mean"},
    # RLOO: leave-one-out baseline, the completion is one action (token sum per sequence).
    "rloo": {**_CRITIC_FREE, "advantage": "rloo", "group_size": 4, "policy_loss": "ppo",
             "eps_low": 0.2, "eps_high": 0.2, "loss_agg": "seq-mean-token-sum"},
    # REINFORCE++: no critic, no groups; per-token KL penalty in the reward (k1), returns
    # whitened over the batch, PPO clip, token mean.
    "reinforce_pp": {**_CRITIC_FREE, "advantage": "reinforce_pp", "policy_loss": "ppo",
                     "eps_low": 0.2, "eps_high": 0.2, "loss_agg": "token-mean",
                     "kl_coef": 0.01, "kl_estimator": "k1", "kl_in_reward": True},
    # Decoupled PPO (Hilton et al. 2022; AReaL): clip around the recomputed proximal policy,
    # behaviour weight pi_prox/pi_behav capped at 5, group-normalised advantages.
    "decoupled_ppo": {**_CRITIC_FREE, "advantage": "grpo", "group_size": 8,
                      "policy_loss": "decoupled_ppo", "old_logprobs": "recompute",
                      "eps_low": 0.2, "eps_high": 0.2, "behavior_weight_cap": 5.0},
    # CISPO (MiniMax-M1): clipped stop-gradient IS weight, no lower bound, token mean.
    "cispo": {**_CRITIC_FREE, "advantage": "grpo", "group_size": 8, "policy_loss": "cispo",
              "eps_low": 1.0, "eps_high": 2.0, "loss_agg": "token-mean"},
}
