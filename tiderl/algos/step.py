"""One optimizer step of any algorithm in the family, dispatched on `AlgoConfig` options.

`algo_step` is the only training entry point the loop needs. `algo.name == "sao"` runs the SAO
step (`sao.sao_step`) unchanged; every other name runs the generic step below, which reads the
option fields (advantage, policy_loss, loss_agg, kl_*, entropy_coef, ...) and never the name.
`needs_critic`, `needs_ref` and `group_size` tell the loop what to build and how to sample, so
the loop stays unaware of the algorithm.

The generic step, in order:

1. rewards: the trajectory's reward, plus DAPO's overlong penalty (`algo.overlong_*`);
   dynamic sampling drops groups whose rewards are all equal (`algo.dynamic_sampling`);
2. one padded batch of all trajectories (`collate`), split into micro-batches (by padded
   tokens, or packed rows with `packed=True`);
3. no-grad forward passes, written back into batch-wide `[N, T]` tensors: recomputed
   old/proximal log-probs (`old_logprobs=recompute`, decoupled_ppo), reference log-probs
   (`kl_coef > 0`), critic values (`advantage=gae`);
4. advantages on the whole batch at once (pure functions; whitening and group statistics are
   batch-wide): GAE with the critic (after K critic updates on Monte-Carlo/lambda targets),
   GRPO / Dr.GRPO / RLOO from group statistics, or REINFORCE++ returns; KL in the reward
   when `kl_in_reward`;
5. `actor_updates` actor optimizer steps: policy token loss -> aggregation with a normaliser
   over the whole batch -> + kl_coef * KL term -> - entropy_coef * entropy term.

Every loss is normalised by the whole batch (`aggregation.loss_normalizer`), so the micro-batch
split changes neither the loss nor the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tiderl.algos.advantages import (
    decoupled_policy_lambda,
    explained_variance,
    masked_whiten,
    outcome_token_rewards,
    skip_observation_gae,
)
from tiderl.algos.aggregation import aggregate, loss_normalizer
from tiderl.algos.group_advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    group_index_of,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from tiderl.algos.losses import value_loss
from tiderl.algos.policy_forward import critic_values, policy_logprobs
from tiderl.algos.policy_losses import (
    cispo_token_loss,
    decoupled_ppo_token_loss,
    dis_token_loss,
    gspo_token_loss,
    ppo_token_loss,
)
from tiderl.algos.regularizers import kl_estimate
from tiderl.algos.sampling import informative_groups, overlong_penalty
from tiderl.algos.sao import sao_step
from tiderl.config import AlgoConfig
from tiderl.train.batching import (
    Batch,
    collate,
    micro_batch_indices,
    pack_trajectories,
    slice_batch,
)
from tiderl.train.learner import Learner
from tiderl.types import Trajectory

__all__ = ["GROUP_ESTIMATORS", "algo_step", "needs_critic", "needs_ref", "group_size",
           "policy_token_loss"]

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def needs_critic(cfg: AlgoConfig) -> bool:
    """True when the algorithm trains a critic (SAO, and any `advantage = gae`)."""
    return cfg.name == "sao" or cfg.advantage == "gae"


def needs_ref(cfg: AlgoConfig) -> bool:
    """True when the algorithm needs a frozen reference model (a KL term: `kl_coef > 0`)."""
    return cfg.name != "sao" and cfg.kl_coef > 0


def group_size(cfg: AlgoConfig) -> int:
    """Rollouts to sample per prompt; they must share `Trajectory.group_id`."""
    return cfg.group_size


# --------------------------------------------------------------------------------------------
# Micro-batches in either layout, addressed into the batch-wide padded [N, T] tensors.


@dataclass
class _Part:
    """One micro-batch: model inputs plus the map from its positions to the padded batch.

    seq_index[r, c] / tok_index[r, c] give the padded-batch coordinates (trajectory, token) of
    position (r, c), -1 on padding. Padded micro-batches are row slices; packed ones are rows
    holding several trajectories. `take` and `put` move per-token tensors between layouts.
    """

    input_ids: torch.Tensor
    model_mask: torch.Tensor  # [r, l] (padded) or boolean [r, 1, l, l] (packed)
    position_ids: torch.Tensor | None
    action_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    seq_index: torch.Tensor  # on the CPU, like the batch-wide tensors
    tok_index: torch.Tensor

    @property
    def seq_ids(self) -> torch.Tensor:
        return self.seq_index.to(self.input_ids.device)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        valid = self.seq_index >= 0
        out = full[self.seq_index.clamp(min=0), self.tok_index.clamp(min=0)]
        return torch.where(valid, out, torch.zeros_like(out)).to(self.input_ids.device)

    def put(self, full: torch.Tensor, x: torch.Tensor) -> None:
        valid = self.seq_index >= 0
        full[self.seq_index[valid], self.tok_index[valid]] = x.detach().cpu()[valid].to(full.dtype)


def _padded_parts(full: Batch, micro_batch_tokens: int, device: torch.device | str
                  ) -> list[_Part]:
    lengths = full.attention_mask.sum(dim=1).tolist()
    parts = []
    for rows in micro_batch_indices(lengths, micro_batch_tokens):
        b = slice_batch(full, rows)
        width = b.input_ids.shape[1]
        valid = b.attention_mask > 0
        seq = torch.tensor(rows, dtype=torch.long).unsqueeze(1).expand(len(rows), width)
        tok = torch.arange(width).unsqueeze(0).expand(len(rows), width)
        neg = torch.full_like(seq, -1)
        d = b.to(device)
        parts.append(_Part(d.input_ids, d.attention_mask, None, d.action_mask,
                           d.behavior_logprobs, torch.where(valid, seq, neg),
                           torch.where(valid, tok, neg)))
    return parts


def _packed_parts(trajectories: list[Trajectory], pad_id: int, micro_batch_tokens: int,
                  device: torch.device | str) -> list[_Part]:
    packed = pack_trajectories(trajectories, pad_id, micro_batch_tokens)
    parts = []
    for r in range(packed.rows):
        row = packed.row(r)
        parts.append(_Part(row.input_ids.to(device), row.attention_mask().to(device),
                           row.position_ids.to(device), row.action_mask.to(device),
                           row.behavior_logprobs.to(device), row.seq_ids, row.token_index))
    return parts


@torch.no_grad()
def _forward_all(parts: list[_Part], shape: tuple[int, int],
                 fn: Callable[[_Part], torch.Tensor]) -> torch.Tensor:
    """Run `fn` on every part and write its per-token output into one [N, T] tensor (CPU)."""
    full = torch.zeros(shape, dtype=torch.float32)
    for p in parts:
        p.put(full, fn(p))
    return full


# --------------------------------------------------------------------------------------------
# The policy loss of a config, as one function.


def policy_token_loss(cfg: AlgoConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                      action_mask: torch.Tensor, seq_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token loss `cfg.policy_loss` names (see `policy_losses.py` for each formula).

    old_logprobs: what the ratio is taken against (behaviour or recomputed); for decoupled_ppo
    they are the proximal log-probs and behavior_logprobs enter the behaviour weight.
    """
    name = cfg.policy_loss
    if name == "dis":
        return dis_token_loss(logprobs, old_logprobs, advantages, action_mask, cfg.eps_low,
                              cfg.eps_high)
    if name == "ppo":
        return ppo_token_loss(logprobs, old_logprobs, advantages, action_mask, cfg.eps_low,
                              cfg.eps_high, cfg.dual_clip_c)
    if name == "decoupled_ppo":
        return decoupled_ppo_token_loss(logprobs, old_logprobs, behavior_logprobs, advantages,
                                        action_mask, cfg.eps_low, cfg.eps_high,
                                        cfg.behavior_weight_cap, cfg.dual_clip_c)
    if name == "cispo":
        return cispo_token_loss(logprobs, old_logprobs, advantages, action_mask, cfg.eps_low,
                                cfg.eps_high)
    if name == "gspo":
        return gspo_token_loss(logprobs, old_logprobs, advantages, action_mask, cfg.eps_low,
                               cfg.eps_high, seq_ids)
    raise ValueError(f"unknown algo.policy_loss {name!r}")


# --------------------------------------------------------------------------------------------
# The step.


def algo_step(
    trajectories: list[Trajectory],
    actor: Learner,
    critic: Learner | None,
    ref: torch.nn.Module | Learner | None,
    cfg: AlgoConfig,
    pad_id: int,
    micro_batch_tokens: int,
    train_actor: bool,
    device: torch.device | str = "cpu",
    packed: bool = False,
) -> dict[str, float]:
    """One optimizer step of the algorithm `cfg` describes. Returns metrics (docs/algorithms.md).

    critic: needed iff `needs_critic(cfg)`; ref: a frozen model (or a Learner holding one),
    needed iff `needs_ref(cfg)`. train_actor=False trains only the critic (warm-up).
    packed=True lays micro-batches out as packed rows of up to `micro_batch_tokens` tokens
    (several trajectories per row, block-diagonal attention); the losses are the same as padded.
    SAO (`cfg.name == "sao"`) runs `sao_step` exactly as before (padded only).
    """
    if cfg.name == "sao":
        if critic is None:
            raise ValueError("algo.name=sao needs a critic (needs_critic(cfg) is True)")
        if packed:
            raise ValueError("the SAO step has no packed layout; call it with packed=False")
        return sao_step(trajectories, actor, critic, cfg, pad_id, micro_batch_tokens,
                        train_actor, device)
    if needs_critic(cfg) and critic is None:
        raise ValueError(f"algo.advantage={cfg.advantage} needs a critic; build one when "
                         "needs_critic(cfg) is True")
    if needs_ref(cfg) and ref is None and not all("ref_logprobs" in t.annotations for t in trajectories):
        raise ValueError(f"algo.kl_coef={cfg.kl_coef} needs a reference model; build one when "
                         "needs_ref(cfg) is True")
    if not trajectories:
        raise ValueError("algo_step() got no trajectories")
    metrics: dict[str, float] = {}

    # 1. Rewards and the sampling-side filters.
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    lengths = torch.tensor([t.num_action_tokens for t in trajectories], dtype=torch.float32)
    if cfg.overlong_buffer > 0:
        penalty = overlong_penalty(lengths, cfg.overlong_max_tokens, cfg.overlong_buffer,
                                   cfg.overlong_penalty)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        metrics["reward/overlong_frac"] = float((penalty < 0).float().mean())
    uses_groups = cfg.advantage in GROUP_ESTIMATORS or cfg.dynamic_sampling
    groups = None
    if uses_groups:
        ids = [t.group_id for t in trajectories]
        if any(g == "" for g in ids):
            raise ValueError(
                f"algo.advantage={cfg.advantage} / dynamic_sampling groups rollouts by "
                "Trajectory.group_id, but some trajectories have an empty group_id. Fix: the "
                "loop must give the group_size rollouts of one prompt the same group_id")
        groups = group_index_of(ids)
        metrics["algo/groups"] = float(int(groups.max()) + 1)
        metrics["algo/group_size_mean"] = len(ids) / metrics["algo/groups"]
    if cfg.dynamic_sampling:
        assert groups is not None
        keep = informative_groups(rewards, groups)
        metrics["sampling/kept_frac"] = float(keep.float().mean())
        if not bool(keep.any()):
            metrics["skipped_no_signal"] = 1.0
            return metrics
        idx = keep.nonzero().squeeze(1)
        trajectories = [trajectories[i] for i in idx.tolist()]
        rewards = rewards[idx]
        groups = group_index_of(groups[idx].tolist())
    metrics["reward/shaped_mean"] = float(rewards.mean())

    # 2. The batch and its micro-batches.
    full = collate(trajectories, pad_id)
    full.rewards = rewards
    mask = full.action_mask
    shape = (mask.shape[0], mask.shape[1])
    if float(mask.sum()) == 0:
        metrics["skipped_no_action_tokens"] = 1.0
        return metrics
    parts = (_packed_parts(trajectories, pad_id, micro_batch_tokens, device) if packed
             else _padded_parts(full, micro_batch_tokens, device))
    normalizer = loss_normalizer(mask, cfg.loss_agg, None, cfg.loss_agg_length)
    n_tokens = float(mask.sum())

    # 3. No-grad forward passes.
    def actor_lp(p: _Part) -> torch.Tensor:
        return policy_logprobs(actor.model, p.input_ids, p.model_mask, p.position_ids)[0]

    recompute = cfg.policy_loss == "decoupled_ppo" or cfg.old_logprobs == "recompute"
    if recompute:
        actor.model.eval()
        old = _forward_all(parts, shape, actor_lp)
        metrics["policy/behavior_gap"] = float(
            ((old - full.behavior_logprobs).abs() * mask).sum() / n_tokens)
    else:
        old = full.behavior_logprobs
    ref_lp = None
    if cfg.kl_coef > 0 and all("ref_logprobs" in t.annotations for t in trajectories):
        # Computed ahead by the asynchronous buffer (reference forward pipelined with training).
        ref_lp = torch.zeros(shape, dtype=torch.float32)
        for i, t in enumerate(trajectories):
            ref_lp[i, : len(t.tokens)] = torch.tensor(t.annotations["ref_logprobs"], dtype=torch.float32)
        ref_lp = ref_lp * mask
        metrics["kl/ref_precomputed"] = 1.0
    elif cfg.kl_coef > 0:
        ref_model = ref.model if isinstance(ref, Learner) else ref
        assert ref_model is not None
        ref_model.eval()
        ref_lp = _forward_all(parts, shape, lambda p: policy_logprobs(
            ref_model, p.input_ids, p.model_mask, p.position_ids)[0])

    def values_of(p: _Part) -> torch.Tensor:
        assert critic is not None
        return critic_values(critic.model, p.input_ids, p.model_mask, p.position_ids)

    # 4. Rewards per token / per trajectory, then advantages on the whole batch.
    kl_tokens = None
    if ref_lp is not None and cfg.kl_in_reward:
        # The penalty is for the policy that sampled the data: behaviour (or recomputed) log-probs.
        kl_tokens = kl_estimate(old, ref_lp, mask, cfg.kl_estimator)
        metrics["kl/reward_kl_mean"] = float(kl_tokens.sum() / n_tokens)
    if cfg.advantage in GROUP_ESTIMATORS:
        assert groups is not None
        seq_rewards = rewards if kl_tokens is None else rewards - cfg.kl_coef * kl_tokens.sum(1)
        estimator = {"grpo": lambda r, g: grpo_advantages(r, g, cfg.adv_eps),
                     "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}[cfg.advantage]
        advantages = broadcast_to_tokens(estimator(seq_rewards, groups), mask)
    else:
        token_rewards = outcome_token_rewards(rewards, mask)
        if kl_tokens is not None:
            token_rewards = token_rewards - cfg.kl_coef * kl_tokens
        if cfg.advantage == "reinforce_pp":
            advantages = reinforce_pp_advantages(token_rewards, mask, cfg.gamma)
        else:
            assert critic is not None
            critic.model.eval()
            values = _forward_all(parts, shape, values_of)
            _, returns = skip_observation_gae(token_rewards, values, mask, cfg.gamma,
                                              cfg.critic_lambda)
            metrics.update(_train_critic(critic, parts, cfg, values, returns, mask, n_tokens))
            if cfg.advantage_values == "after":
                critic.model.eval()
                values = _forward_all(parts, shape, values_of)
            lam: float | torch.Tensor = (
                decoupled_policy_lambda(full.num_action_tokens, cfg.lambda_alpha)
                if cfg.decoupled_lambda else cfg.policy_lambda)
            advantages, _ = skip_observation_gae(token_rewards, values, mask, cfg.gamma, lam)
    if cfg.normalize_advantages:
        advantages = masked_whiten(advantages, mask)
    adv_flat = advantages[mask > 0]
    metrics["policy/advantage_mean"] = float(adv_flat.mean())
    metrics["policy/advantage_abs_mean"] = float(adv_flat.abs().mean())

    # 5. The actor.
    if train_actor:
        metrics.update(_train_actor(actor, parts, cfg, old, ref_lp, advantages, normalizer))
    metrics["micro_batches"] = float(len(parts))
    return metrics


def _train_critic(critic: Learner, parts: list[_Part], cfg: AlgoConfig, values: torch.Tensor,
                  returns: torch.Tensor, mask: torch.Tensor, n_tokens: float) -> dict[str, float]:
    """K critic optimizer steps towards `returns` (token-mean value loss, as in SAO)."""
    on = mask > 0
    metrics = {
        "value/explained_variance": explained_variance(values[on], returns[on],
                                                       torch.ones_like(values[on])),
        "value/mean": float(values[on].mean()),
        "value/return_mean": float(returns[on].mean()),
    }
    clip = cfg.value_clip if cfg.value_clip > 0 else None

    def loss_fn(p: _Part) -> tuple[torch.Tensor, dict[str, float]]:
        v = critic_values(critic.model, p.input_ids, p.model_mask, p.position_ids)
        return value_loss(v, p.take(returns), p.action_mask, n_tokens,
                          old_values=p.take(values) if clip else None, clip_eps=clip)

    for k in range(cfg.critic_updates):
        cm = critic.step(parts, loss_fn)
        if k == 0:
            metrics["value/loss_first"] = cm["loss"]
        metrics["value/loss"] = cm["loss"]
        metrics["value/grad_norm"] = cm["grad_norm"]
    return metrics


# Loss-specific metric names: DIS keeps SAO's names, everything else goes under policy/.
_DIS_NAMES = {"dis_masked_frac": "dis/masked_frac", "dis_low_frac": "dis/low_frac",
              "dis_high_frac": "dis/high_frac"}


def _train_actor(actor: Learner, parts: list[_Part], cfg: AlgoConfig, old: torch.Tensor,
                 ref_lp: torch.Tensor | None, advantages: torch.Tensor, normalizer: float
                 ) -> dict[str, float]:
    """`cfg.actor_updates` actor optimizer steps on the batch."""
    kl_loss = ref_lp is not None and not cfg.kl_in_reward
    entropy_mode = "grad" if cfg.entropy_coef > 0 else "detached"

    def loss_fn(p: _Part) -> tuple[torch.Tensor, dict[str, float]]:
        lp, ent = policy_logprobs(actor.model, p.input_ids, p.model_mask, p.position_ids,
                                  entropy=entropy_mode)
        assert ent is not None
        seq_ids = p.seq_ids if p.position_ids is not None else None
        token_loss, lm = policy_token_loss(cfg, lp, p.take(old), p.behavior_logprobs,
                                           p.take(advantages), p.action_mask, seq_ids)
        pg = aggregate(token_loss, p.action_mask, cfg.loss_agg, normalizer, seq_ids)
        loss = pg
        out = {_DIS_NAMES.get(k, f"policy/{k}"): v for k, v in lm.items()
               if k != "num_action_tokens"}
        out["pg_loss"] = float(pg.detach())
        on = p.action_mask > 0
        n = max(float(on.sum()), 1.0)
        if kl_loss:
            assert ref_lp is not None
            kl = kl_estimate(lp, p.take(ref_lp), p.action_mask, cfg.kl_estimator)
            kl_term = aggregate(kl, p.action_mask, cfg.loss_agg, normalizer, seq_ids)
            loss = loss + cfg.kl_coef * kl_term
            out["kl_loss"] = float(kl_term.detach())
            out["kl/ref_kl_mean"] = float(kl.detach()[on].sum()) / n
        if cfg.entropy_coef > 0:
            ent_term = aggregate(ent, p.action_mask, cfg.loss_agg, normalizer, seq_ids)
            loss = loss - cfg.entropy_coef * ent_term
        out["policy/entropy"] = float(ent.detach()[on].sum()) / n
        return loss, out

    metrics: dict[str, float] = {}
    for k in range(cfg.actor_updates):
        am = actor.step(parts, loss_fn)
        if k == 0:
            metrics["policy/loss_first"] = am["loss"]
        # Learner averages metrics over micro-batches; loss terms are sums over them.
        for key in ("pg_loss", "kl_loss"):
            if key in am:
                metrics[f"policy/{key}"] = am.pop(key) * len(parts)
        metrics.update(am)
    metrics["policy/loss"] = metrics.pop("loss")
    metrics["policy/grad_norm"] = metrics.pop("grad_norm")
    return metrics
