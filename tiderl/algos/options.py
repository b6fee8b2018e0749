"""The algorithm options (flat `algo.*` keys), each declared by what reads it: the trainer, the
critic, an estimator, a loss or a term. `tiderl.algos.registry` registers the estimators and
losses with theirs and assembles `AlgoConfig` from all, so the keys a run leaves unread follow
from its choices. Each part checks its own fields (`check(self, cfg)`, named as written here) and
may say which of them its own values turn off (`unread`). Torch-free: the config imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.algos.presets import PRESETS
from tiderl.options import need, opt


@dataclass
class TrainerOptions:
    """What every algorithm reads: the preset, the choice of estimator and loss, how token losses
    aggregate, the actor's optimiser (`tiderl.train.step.train_step`)."""

    name: str = opt("sao", "Algorithm preset: sao (single rollout, critic, DIS), ppo, grpo, dr_grpo, dapo, gspo, "
                    "rloo, reinforce_pp, decoupled_ppo, cispo. The preset sets the defaults of the algorithm "
                    "options; keys you set yourself win.", tuple(PRESETS))
    gamma: float = opt(1.0, "Discount.")
    actor_lr: float = opt(1e-6, "Actor learning rate (AdamW).")
    normalize_advantages: bool = opt(False, "Whiten advantages over the batch's action tokens.")
    advantage: str = opt("gae", "Advantage estimator: gae (critic, skip-observation GAE), grpo ((r - group mean) / "
                         "(group std + adv_eps)), dr_grpo (r - group mean), rloo (leave-one-out group mean), "
                         "reinforce_pp (discounted returns whitened over the batch), or a 'module:function'.")
    group_size: int = opt(1, "Rollouts sampled per prompt (they share Trajectory.group_id). grpo/dr_grpo/rloo and "
                          "dynamic_sampling need >= 2.")
    policy_loss: str = opt(
        "dis", "Policy loss: dis (SAO's double-sided band), ppo (clip, clip-higher, dual clip), decoupled_ppo "
        "(clip around recomputed proximal log-probs, times pi_prox/pi_behav), cispo (clipped stop-gradient IS "
        "weight x log-prob), gspo (sequence-level ratio and clip), or a 'module:function'.")
    old_logprobs: str = opt("behavior", "The log-probs ratios are taken against: behavior (the engine's, as sampled) "
                            "or recompute (the trainer's weights before this step's update; one extra forward pass). "
                            "decoupled_ppo always recomputes them as its proximal policy.", ("behavior", "recompute"))
    loss_agg: str = opt(
        "token-mean", "How token losses become one number: token-mean (all action tokens of the step), "
        "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (token sum / loss_agg_length, mean "
        "over sequences).", ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    loss_agg_length: int = opt(0, "seq-mean-token-sum-norm: the constant token count each sequence's loss sum is "
                               "divided by (e.g. the generation budget).")
    actor_updates: int = opt(1, "Actor optimizer steps on each batch (PPO epochs).")
    dynamic_sampling: bool = opt(False, "Drop groups whose rewards are all equal (they carry no advantage).")

    def check(self, cfg: Any) -> None:
        need(0 <= self.gamma <= 1, "gamma", f"{self.gamma} is outside [0, 1]", "use 1.0")
        need(self.actor_lr > 0, "actor_lr", "must be > 0", "use e.g. 1e-6")
        need(self.group_size >= 1, "group_size", "must be >= 1", "use 1 (one rollout per prompt)")
        need(not self.dynamic_sampling or self.group_size >= 2, "dynamic_sampling",
             "drops groups of equal rewards, and every group of one is such a group",
             "set algo.group_size >= 2 or algo.dynamic_sampling=false")
        need(cfg.rollout.batch_size % self.group_size == 0, "group_size",
             f"{self.group_size} does not divide rollout.batch_size={cfg.rollout.batch_size}",
             "make rollout.batch_size a multiple of algo.group_size")
        need((self.loss_agg == "seq-mean-token-sum-norm") == (self.loss_agg_length > 0), "loss_agg_length",
             f"is {self.loss_agg_length} with algo.loss_agg={self.loss_agg}; it must be > 0 exactly when loss_agg "
             "is seq-mean-token-sum-norm", "set it to the generation budget (e.g. rollout.max_new_tokens * "
             "env.max_turns) with seq-mean-token-sum-norm, else 0")
        need(self.actor_updates >= 1, "actor_updates", "must be >= 1", "use 1")


@dataclass
class CriticOptions:
    """The critic's (`tiderl.train.critic`): read when the estimator needs one (`needs_critic`)."""

    critic_lambda: float = opt(1.0, "GAE lambda of the critic's targets (1 = Monte Carlo).")
    critic_lr: float = opt(5e-6, "Critic learning rate (AdamW).")
    critic_updates: int = opt(2, "Critic optimizer steps per actor step (K).")
    critic_warmup_steps: int = opt(10, "First steps train the critic only (actor frozen).")
    freeze_critic_attention: bool = opt(True, "Freeze the critic's attention parameters.")
    critic_freeze_pattern: str = opt(r"self_attn\.", "Regex over parameter names frozen in the critic (must match "
                                     "some).")
    advantage_values: str = opt("before", "Critic values used for the actor's advantages: from before or after this "
                                "step's critic update (not public in the paper).", ("before", "after"))
    value_clip: float = opt(0.0, "Clip the value loss around the old values (0 = off).")
    value_init: str = opt("", "Directory of a pretrained critic to start from ('' = the policy).")

    def check(self, cfg: Any) -> None:
        need(0 <= self.critic_lambda <= 1, "critic_lambda", f"{self.critic_lambda} is outside [0, 1]",
             "use 1.0 (Monte Carlo)")
        need(self.critic_lr > 0, "critic_lr", "must be > 0", "use e.g. 5e-6")
        need(self.critic_updates >= 1, "critic_updates", "must be >= 1", "use 2")
        need(self.critic_warmup_steps >= 0, "critic_warmup_steps", "must be >= 0", "use 10")


# ---------------------------------------------------------------- advantage estimators


@dataclass
class GAEOptions:
    """`gae` (`tiderl.algos.advantages.gae_advantages`): the actor's GAE lambda."""

    decoupled_lambda: bool = opt(True, "gae: SAO's per-trajectory policy lambda 1 - 1/(lambda_alpha * action "
                                 "tokens); false = the fixed policy_lambda.")
    lambda_alpha: float = opt(1.5, "Decoupled policy lambda = 1 - 1/(alpha * action tokens).")
    policy_lambda: float = opt(0.95, "gae: the actor's GAE lambda when decoupled_lambda is false.")

    def check(self, cfg: Any) -> None:
        need(self.lambda_alpha > 0, "lambda_alpha", "must be > 0", "use 1.5")
        need(0 <= self.policy_lambda <= 1, "policy_lambda", f"{self.policy_lambda} is outside [0, 1]", "use 0.95")

    def unread(self, cfg: Any) -> dict[str, str]:
        if self.decoupled_lambda:
            return {"policy_lambda": "only GAE with a fixed lambda reads it (algo.decoupled_lambda=false)"}
        return {"lambda_alpha": "only the decoupled policy lambda reads it (algo.decoupled_lambda=true)"}


@dataclass
class GRPOOptions:
    """`grpo` (`tiderl.algos.advantages.grpo_token_advantages`)."""

    adv_eps: float = opt(1e-6, "grpo: epsilon added to the group std.")

    def check(self, cfg: Any) -> None:
        need(self.adv_eps >= 0, "adv_eps", "must be >= 0", "use 1e-6")


# ---------------------------------------------------------------- policy losses (tiderl.algos.losses)


@dataclass
class ClipOptions:
    """The ratio band every built-in loss reads (dis, cispo and gspo read nothing else)."""

    eps_low: float = opt(0.3, "Lower ratio bound 1 - eps_low: DIS drops tokens at or below it; ppo/gspo clip there; "
                         "cispo clips the weight there (1 = no lower bound).")
    eps_high: float = opt(5.0, "Upper ratio bound 1 + eps_high (DIS drop, PPO/GSPO clip, CISPO weight cap); eps_high "
                          "> eps_low is DAPO's clip-higher.")

    def check(self, cfg: Any) -> None:
        need(0 < self.eps_low <= 1, "eps_low", f"{self.eps_low} is outside (0, 1]",
             "use a value such as 0.3 (1 = no lower bound)")
        need(self.eps_high > 0, "eps_high", f"{self.eps_high} must be > 0", "use a value such as 5.0")


@dataclass
class PPOOptions(ClipOptions):
    """`ppo`: the band and the dual clip."""

    dual_clip_c: float = opt(
        0.0, "ppo/decoupled_ppo dual clip: for A < 0 the objective is at least c * A (c > 1; 0 = off).")

    def check(self, cfg: Any) -> None:
        need(self.dual_clip_c == 0 or self.dual_clip_c > 1, "dual_clip_c", f"{self.dual_clip_c} must be > 1 "
             "(or 0 = off)", "use 3.0 or 0")


@dataclass
class DecoupledPPOOptions(PPOOptions):
    """`decoupled_ppo`: PPO's options and the behaviour weight's cap."""

    behavior_weight_cap: float = opt(
        0.0, "decoupled_ppo: cap on the behaviour weight pi_prox/pi_behav (>= 1; 0 = no cap).")

    def check(self, cfg: Any) -> None:
        need(self.behavior_weight_cap == 0 or self.behavior_weight_cap >= 1, "behavior_weight_cap",
             f"{self.behavior_weight_cap} would shrink on-policy tokens (weight 1)",
             "use a cap >= 1 such as 5.0, or 0 for none")


# ---------------------------------------------------------------- terms every algorithm has


@dataclass
class RegularizerOptions:
    """The KL and entropy terms (`tiderl.algos.regularizers`)."""

    kl_coef: float = opt(0.0, "Weight of the KL to a frozen reference model (0 = off, no ref).")
    kl_estimator: str = opt("k3", "KL estimator: k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r, with r = "
                            "pi/pi_ref.", ("k1", "k2", "k3"))
    kl_in_reward: bool = opt(False, "true: subtract kl_coef * KL from the rewards (per token; summed per trajectory "
                             "for group estimators); false: add kl_coef * KL to the loss.")
    kl_k3_clamp: float = opt(10.0, "k3 only: each token's k3 is at most this; a token above it gets no KL gradient, "
                             "below it value and gradient are k3's own (|gradient| <= c + log(2c + 2)). Unclamped, "
                             "log pi - log pi_ref = -15 gives a value and gradient of 3.3e6.")
    entropy_coef: float = opt(0.0, "Entropy bonus: the loss gets -entropy_coef * mean entropy.")

    def check(self, cfg: Any) -> None:
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0", "use 0 (off) or e.g. 0.04")
        need(0 < self.kl_k3_clamp < float("inf"), "kl_k3_clamp", f"{self.kl_k3_clamp} must be a positive finite "
             "number", "use 10")
        need(self.entropy_coef >= 0, "entropy_coef", "must be >= 0", "use 0 (off) or e.g. 1e-3")

    def unread(self, cfg: Any) -> dict[str, str]:
        if self.kl_coef == 0:
            return dict.fromkeys(("kl_estimator", "kl_in_reward", "kl_k3_clamp"), "algo.kl_coef=0 turns the KL term off")
        if self.kl_estimator != "k3":
            return {"kl_k3_clamp": "only the k3 KL estimator reads it (algo.kl_coef > 0 and algo.kl_estimator=k3)"}
        return {}


@dataclass
class OverlongOptions:
    """DAPO's soft overlong penalty on the rewards (`tiderl.algos.sampling`)."""

    overlong_buffer: int = opt(0, "Soft overlong penalty: responses longer than overlong_max_tokens - "
                               "overlong_buffer action tokens lose up to overlong_penalty linearly (0 = off).")
    overlong_max_tokens: int = opt(0, "Overlong penalty: the action-token limit L_max.")
    overlong_penalty: float = opt(1.0, "Overlong penalty: the reward lost at L_max and beyond.")

    def check(self, cfg: Any) -> None:
        need(self.overlong_buffer >= 0, "overlong_buffer", "must be >= 0", "use 0 (off)")
        need(self.overlong_buffer == 0 or self.overlong_max_tokens > self.overlong_buffer, "overlong_max_tokens",
             f"{self.overlong_max_tokens} must exceed algo.overlong_buffer={self.overlong_buffer}",
             "set it to the action-token limit, e.g. rollout.max_new_tokens * env.max_turns")
        need(self.overlong_penalty >= 0, "overlong_penalty", "must be >= 0", "use 1.0")

    def unread(self, cfg: Any) -> dict[str, str]:
        why = "algo.overlong_buffer=0 turns the overlong penalty off"
        return dict.fromkeys(("overlong_max_tokens", "overlong_penalty"), why) if self.overlong_buffer == 0 else {}
