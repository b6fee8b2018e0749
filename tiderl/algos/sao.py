"""One SAO optimizer step over a batch of finished trajectories (papers.md §SAO).

The order of operations, in one place:

1. critic values V for every token (current critic, no grad), unless every trajectory already
   carries them in `annotations["values"]` (computed ahead by the asynchronous buffer);
2. critic targets: skip-observation GAE with the critic's lambda (1 = Monte-Carlo return);
3. K critic optimizer steps on those targets (K = `algo.critic_updates`);
4. actor advantages: skip-observation GAE with the decoupled, per-trajectory policy lambda,
   from the values before (default) or after the critic update (`algo.advantage_values`);
5. one actor optimizer step with the DIS loss against the engine's `behavior_logprobs`,
   skipped during the critic-only warm-up.

The heavy lifting lives in pure functions (`advantages.py`, `losses.py`) and in `Learner`;
this module only composes them, so another algorithm is another short module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiderl.algos.advantages import (
    decoupled_policy_lambda,
    explained_variance,
    outcome_token_rewards,
    skip_observation_gae,
)
from tiderl.algos.losses import dis_policy_loss, value_loss
from tiderl.config import AlgoConfig
from tiderl.train.batching import Batch, collate, micro_batch_indices, slice_batch
from tiderl.train.forward import token_logprobs, token_values
from tiderl.train.learner import Learner
from tiderl.types import Trajectory


@dataclass
class MicroBatch:
    """A slice of the step's batch plus the per-token targets computed for it."""

    batch: Batch
    rewards: torch.Tensor  # the outcome reward on each trajectory's last action token, [b, t]
    values: torch.Tensor  # critic values before the update, [b, t]
    returns: torch.Tensor  # critic targets
    advantages: torch.Tensor | None = None


@torch.no_grad()
def _values(critic: torch.nn.Module, mb: Batch) -> torch.Tensor:
    critic.eval()
    return token_values(critic, mb.input_ids, mb.attention_mask)


def _annotated_values(trajectories: list[Trajectory], rows: list[int], mb: Batch) -> torch.Tensor:
    """The rows' `annotations["values"]` laid out like `mb` (right-padded with zeros)."""
    out = torch.zeros(mb.action_mask.shape, dtype=torch.float32, device=mb.action_mask.device)
    for i, row in enumerate(rows):
        values = trajectories[row].annotations["values"]
        if len(values) != len(trajectories[row].tokens):
            raise ValueError(f"trajectory {row} has {len(values)} precomputed values for "
                             f"{len(trajectories[row].tokens)} tokens")
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def sao_step(
    trajectories: list[Trajectory],
    actor: Learner,
    critic: Learner,
    algo: AlgoConfig,
    pad_id: int,
    micro_batch_tokens: int,
    train_actor: bool,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Apply one SAO update (critic K times, actor once unless warming up). Returns metrics."""
    full = collate(trajectories, pad_id)
    lengths = full.attention_mask.sum(dim=1).tolist()
    groups = micro_batch_indices(lengths, micro_batch_tokens)
    normalizer = float(full.action_mask.sum().item())
    if normalizer == 0:
        return {"skipped_no_action_tokens": 1.0}

    # Critic values computed ahead of the step (the asynchronous buffer's pipelined critic
    # forward, from a snapshot of the critic) are used as they are; otherwise compute them now.
    precomputed = all("values" in t.annotations for t in trajectories)
    mbs: list[MicroBatch] = []
    for rows in groups:
        b = slice_batch(full, rows).to(device)
        if precomputed:
            values = _annotated_values(trajectories, rows, b)
        else:
            values = _values(critic.model, b)
        rewards = outcome_token_rewards(b.rewards, b.action_mask)
        _, returns = skip_observation_gae(rewards, values, b.action_mask, algo.gamma,
                                          algo.critic_lambda)
        mbs.append(MicroBatch(b, rewards, values, returns))

    all_values = torch.cat([m.values[m.batch.action_mask > 0] for m in mbs])
    all_returns = torch.cat([m.returns[m.batch.action_mask > 0] for m in mbs])
    metrics: dict[str, float] = {
        "value/precomputed": float(precomputed),
        "value/explained_variance": explained_variance(
            all_values, all_returns, torch.ones_like(all_values)),
        "value/mean": float(all_values.mean()),
        "value/return_mean": float(all_returns.mean()),
    }

    clip = algo.value_clip if algo.value_clip > 0 else None

    def critic_loss(m: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        v = token_values(critic.model, m.batch.input_ids, m.batch.attention_mask)
        return value_loss(v, m.returns, m.batch.action_mask, normalizer,
                          old_values=m.values if clip else None, clip_eps=clip)

    for k in range(algo.critic_updates):
        cm = critic.step(mbs, critic_loss)
        if k == 0:
            metrics["value/loss_first"] = cm["loss"]
        metrics["value/loss"] = cm["loss"]
        metrics["value/grad_norm"] = cm["grad_norm"]

    for m in mbs:
        values = m.values if algo.advantage_values == "before" else _values(critic.model, m.batch)
        lam = decoupled_policy_lambda(m.batch.num_action_tokens, algo.lambda_alpha)
        m.advantages, _ = skip_observation_gae(m.rewards, values, m.batch.action_mask,
                                               algo.gamma, lam)
    if algo.normalize_advantages:
        # Whiten over the whole step's action tokens, not per micro-batch.
        flat = torch.cat([m.advantages[m.batch.action_mask > 0] for m in mbs])
        mean, std = flat.mean(), flat.std().clamp(min=1e-6)
        for m in mbs:
            m.advantages = (m.advantages - mean) / std * m.batch.action_mask
    adv_flat = torch.cat([m.advantages[m.batch.action_mask > 0] for m in mbs])
    metrics["policy/advantage_mean"] = float(adv_flat.mean())
    metrics["policy/advantage_abs_mean"] = float(adv_flat.abs().mean())

    if train_actor:

        def actor_loss(m: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            lp, ent = token_logprobs(actor.model, m.batch.input_ids, m.batch.attention_mask,
                                     with_entropy=True)
            loss, lm = dis_policy_loss(lp, m.batch.behavior_logprobs, m.advantages,
                                       m.batch.action_mask, algo.eps_low, algo.eps_high,
                                       normalizer)
            mask = m.batch.action_mask
            lm["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
            return loss, lm

        am = actor.step(mbs, actor_loss)
        metrics.update({
            "policy/loss": am["loss"],
            "policy/grad_norm": am["grad_norm"],
            "policy/entropy": am["entropy"],
            "dis/masked_frac": am["dis_masked_frac"],
            "dis/low_frac": am["dis_low_frac"],
            "dis/high_frac": am["dis_high_frac"],
            "dis/ratio_mean": am["ratio_mean"],
            "dis/ratio_max": am["ratio_max"],
            "dis/approx_kl": am["approx_kl"],
        })
    metrics["micro_batches"] = float(len(mbs))
    return metrics

