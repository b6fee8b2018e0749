"""One optimizer step of any algorithm: the trainer's side of `tiderl.algos`. What it does, in
order, and why the micro-batch split changes neither loss nor gradient: docs/algorithms.md, "One step".
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from tiderl.algos import registry
from tiderl.algos.advantages import (
    AdvantageInputs,
    explained_variance,
    group_index_of,
    masked_whiten,
    outcome_token_rewards,
    skip_observation_gae,
)
from tiderl.algos.aggregation import aggregate, loss_normalizer
from tiderl.algos.losses import PolicyLossInputs, value_loss
from tiderl.algos.regularizers import kl_estimate, kl_reward_penalty
from tiderl.algos.sampling import informative_groups, overlong_penalty
from tiderl.train.batching import Batch, collate, micro_batch_indices, slice_batch
from tiderl.train.forward import (
    packed_token_logprobs,
    packs,
    token_logprobs,
    token_values,
)
from tiderl.train.learner import Learner
from tiderl.types import Trajectory

if TYPE_CHECKING:
    from tiderl.config import AlgoConfig

__all__ = ["NonFiniteError", "train_step"]

logger = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A reward, loss or gradient of the step is NaN or infinite (the message names where)."""


_SKIP_FIX = "Fix: find the cause there, or set train.nonfinite=skip to skip and count such data."


def _tasks(trajectories: list[Trajectory], rows: list[int] | None = None) -> str:
    picked = trajectories if rows is None else [trajectories[i] for i in rows]
    ids = sorted({t.task_id for t in picked})
    return ", ".join(ids[:8]) + (f" (+{len(ids) - 8} more)" if len(ids) > 8 else "")


@contextlib.contextmanager
def _finite_guard(learner: Learner, what: str, trajectories: list[Trajectory]) -> Iterator[None]:
    """Refuse the optimizer step of `learner` while any gradient is non-finite (checked after
    clipping: a non-finite norm makes every clipped gradient NaN), so the weights stay as they were."""

    def check(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # One batched norm is finite iff every element is (docs/bench_vs_trl.md); only when it is
        # not (or overflows) is each gradient checked.
        if grads and all(type(g) is torch.Tensor for g in grads) and bool(
                torch.isfinite(torch.nn.utils.get_total_norm(grads))):
            return
        for g in grads:
            if not bool(torch.isfinite(g).all()):
                raise NonFiniteError(f"the {what} gradient is non-finite (NaN or inf) on the batch of tasks "
                                     f"{_tasks(trajectories)}; the weights were not updated. {_SKIP_FIX}")

    handle = learner.optimizer.register_step_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class _Micro:
    """One micro-batch: its rows of the batch, and their tensors on the device, trimmed to the
    longest of them."""

    rows: torch.Tensor
    batch: Batch
    # A copy that a data-parallel rank runs with weight 0, only so that every rank runs as many
    # forward/backward passes as the others (tiderl.train.parallel.assign_micro_batches).
    ghost: bool = False

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of a batch-wide [N, T] tensor, on its device."""
        return full[self.rows, : self.batch.input_ids.shape[1]].to(self.batch.input_ids.device)


def _logprobs(model: torch.nn.Module, b: Batch, packed: bool | None, temperature: float,
              with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of micro-batch `b` at `temperature`, packed (no padding; the values only
    where `b.action_mask` is 1, which is all any loss reads) when `packed` is True, or None and
    `packs(model)`; never for a micro-batch with images (`b.pixels`), which runs right-padded."""
    if b.pixels is None and (packed or (packed is None and packs(model))):
        return packed_token_logprobs(model, b.input_ids, b.attention_mask, b.action_mask, with_entropy, entropy_grad,
                                     temperature=temperature)
    return token_logprobs(model, b.input_ids, b.attention_mask, with_entropy, entropy_grad, temperature=temperature,
                          pixels=b.pixels)


@torch.no_grad()
def _forward_all(micros: list[_Micro], shape: torch.Size,
                 fn: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
    """`fn` on every micro-batch, gathered into one [N, T] CPU tensor (0 on padding)."""
    full = torch.zeros(shape, dtype=torch.float32)
    for m in micros:
        out = fn(m.batch)
        if m.ghost:
            continue
        out = torch.where(m.batch.attention_mask > 0, out, torch.zeros_like(out))
        full[m.rows, : out.shape[1]] = out.float().cpu()
    return full


def _annotated(trajectories: list[Trajectory], key: str, shape: torch.Size
               ) -> torch.Tensor | None:
    """The trajectories' `annotations[key]` as one [N, T] tensor, or None unless all have it."""
    if not all(key in t.annotations for t in trajectories):
        return None
    out = torch.zeros(shape, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        values = t.annotations[key]
        if len(values) != len(t.tokens):
            raise ValueError(f"trajectory {i} has {len(values)} precomputed {key!r} for "
                             f"{len(t.tokens)} tokens (one per token is needed)")
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def train_step(
    trajectories: list[Trajectory],
    actor: Learner,
    critic: Learner | None,
    ref: torch.nn.Module | Learner | None,
    cfg: AlgoConfig,
    pad_id: int,
    micro_batch_tokens: int,
    train_actor: bool,
    device: torch.device | str = "cpu",
    nonfinite: str = "error",
    packed: bool | None = None,
    skip_zero_advantage: bool = True,
    temperature: float = 1.0,
    image_processor: Any = None,
) -> dict[str, float]:
    """One optimizer step of the algorithm `cfg` describes; returns its metrics (docs/metrics.md,
    docs/algorithms.md).

    critic: needed iff `registry.needs_critic(cfg)`; ref: a frozen model (or a Learner holding
    one), needed iff `registry.needs_ref(cfg)` unless every trajectory carries
    `annotations["ref_logprobs"]`. Micro-batches hold at most `micro_batch_tokens` padded tokens
    (a longer trajectory gets one of its own). train_actor=False trains only the critic.
    nonfinite: "error" raises `NonFiniteError` naming the trajectory (task) whose reward, or the
    tasks of the micro-batch whose loss or gradient, is NaN/inf; "skip" leaves such trajectories
    out (`nonfinite/skipped_trajectories`) or skips the optimizer step (`nonfinite/skipped_step`).
    packed: run the policy's passes packed (`forward.packed_token_logprobs`); None = whenever the
    model supports it (`forward.packs`), False = right-padded; both give the same gradients.
    skip_zero_advantage: leave trajectories whose advantages are all 0 out of the actor's passes
    when that cannot change its gradient (docs/algorithms.md, "Zero-advantage trajectories").
    temperature: the one the trajectories were sampled at (`forward.logprob_temperature`).
    image_processor: turns `Trajectory.images` into pixel inputs (a vision-language model's
        `processor.image_processor`); needed iff some trajectory shows images.
    """
    skip = nonfinite == "skip"
    try:
        return _train_step(trajectories, actor, critic, ref, cfg, pad_id, micro_batch_tokens, train_actor, device,
                           skip=skip, packed=packed, skip_zero_advantage=skip_zero_advantage, temperature=temperature,
                           image_processor=image_processor)
    except NonFiniteError as exc:
        if not skip:
            raise
        logger.warning("skipping the optimizer step: %s", exc)  # train.nonfinite=skip: counted, the weights unchanged
        return {"nonfinite/skipped_step": 1.0}


def _train_step(trajectories: list[Trajectory], actor: Learner, critic: Learner | None,
                ref: torch.nn.Module | Learner | None, cfg: AlgoConfig, pad_id: int, micro_batch_tokens: int,
                train_actor: bool, device: torch.device | str, skip: bool, packed: bool | None,
                skip_zero_advantage: bool, temperature: float = 1.0, image_processor: Any = None) -> dict[str, float]:
    if not trajectories:
        raise ValueError("train_step() got no trajectories")
    if registry.needs_critic(cfg) and critic is None:
        raise ValueError(f"algo.advantage={cfg.advantage} needs a critic; build one when "
                         "needs_critic(cfg) is True")
    if (registry.needs_ref(cfg) and ref is None
            and not all("ref_logprobs" in t.annotations for t in trajectories)):
        raise ValueError(f"algo.kl_coef={cfg.kl_coef} needs a reference model; build one when "
                         "needs_ref(cfg) is True")
    metrics: dict[str, float] = {}

    # 1. Rewards and the sampling-side filters.
    bad = [i for i, t in enumerate(trajectories) if not math.isfinite(t.reward)]
    if bad and not skip:
        t = trajectories[bad[0]]
        raise NonFiniteError(f"{len(bad)} of {len(trajectories)} trajectories have a non-finite reward; the first: "
                             f"trajectory {bad[0]} of the batch, task {t.task_id!r} (group {t.group_id!r}), reward "
                             f"{t.reward!r}, parts {t.reward_parts}, env info {t.env_info}: the environment (or "
                             f"a reward shaper) produced it. {_SKIP_FIX}")
    if bad:
        metrics["nonfinite/skipped_trajectories"] = float(len(bad))
        trajectories = [t for i, t in enumerate(trajectories) if math.isfinite(t.reward)]
        if not trajectories:
            return metrics
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    if cfg.overlong_buffer > 0:
        lengths = torch.tensor([t.num_action_tokens for t in trajectories], dtype=torch.float32)
        penalty = overlong_penalty(lengths, cfg.overlong_max_tokens, cfg.overlong_buffer,
                                   cfg.overlong_penalty)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        metrics["reward/overlong_frac"] = float((penalty < 0).float().mean())
    groups = None
    if registry.uses_groups(cfg):
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
    full = collate(trajectories, pad_id, image_processor)
    mask, shape = full.action_mask, full.action_mask.shape
    n_tokens = float(mask.sum())
    if n_tokens == 0:
        metrics["skipped_no_action_tokens"] = 1.0
        return metrics
    micros = _micro_batches(full, list(range(len(trajectories))), micro_batch_tokens, device)
    # This process's share of them (all, unless the learner is a data-parallel rank, whose
    # no-grad passes then fill only their rows and are summed across the ranks).
    local = actor.local_share(micros)

    # 3. No-grad passes.
    old = full.behavior_logprobs
    if registry.recomputes_old_logprobs(cfg):
        actor.model.eval()
        old = actor.sum_across_ranks(_forward_all(
            local, shape, lambda b: _logprobs(actor.model, b, packed, temperature)[0]))
        metrics["policy/behavior_gap"] = float(
            ((old - full.behavior_logprobs).abs() * mask).sum() / n_tokens)
    ref_lp = None
    if registry.needs_ref(cfg):
        ref_lp = _annotated(trajectories, "ref_logprobs", shape)
        if ref_lp is not None:
            metrics["kl/ref_precomputed"] = 1.0
        else:
            ref_model = ref.model if isinstance(ref, Learner) else ref
            assert ref_model is not None
            ref_model.eval()
            # Padded: the packed pass switches the model's attention kernel for its duration, and
            # the reference may be serving the buffer's RefLogprobs on another thread meanwhile.
            ref_lp = actor.sum_across_ranks(_forward_all(local, shape, lambda b: token_logprobs(
                ref_model, b.input_ids, b.attention_mask, temperature=temperature, pixels=b.pixels)[0]))

    # 4. Rewards per token, the critic, the advantages of the whole batch.
    token_rewards = outcome_token_rewards(rewards, mask)
    if ref_lp is not None and cfg.kl_in_reward:
        # The penalty is for the policy that sampled the data: behaviour (or recomputed) log-probs.
        token_rewards, kl = kl_reward_penalty(token_rewards, old, ref_lp, mask, cfg.kl_coef,
                                              cfg.kl_estimator, cfg.kl_k3_clamp)
        rewards = rewards - cfg.kl_coef * kl.sum(dim=1)
        metrics["kl/reward_kl_mean"] = float(kl.sum() / n_tokens)
    values = None
    if critic is not None and registry.needs_critic(cfg):
        critic_model = critic.model

        def critic_forward(b: Batch) -> torch.Tensor:
            return token_values(critic_model, b.input_ids, b.attention_mask, b.pixels)

        values = _annotated(trajectories, "values", shape)
        metrics["value/precomputed"] = float(values is not None)
        if values is None:
            critic_model.eval()
            values = critic.sum_across_ranks(_forward_all(local, shape, critic_forward))
        _, returns = skip_observation_gae(token_rewards, values, mask, cfg.gamma,
                                          cfg.critic_lambda)
        metrics.update(_train_critic(critic, local, cfg, values, returns, mask, n_tokens, trajectories))
        if cfg.advantage_values == "after":
            critic_model.eval()
            values = critic.sum_across_ranks(_forward_all(local, shape, critic_forward))
    inputs = AdvantageInputs(rewards, token_rewards, mask, full.num_action_tokens, groups, values)
    advantages = registry.advantage_fn(cfg.advantage)(inputs, cfg)
    if advantages.shape != shape:
        raise ValueError(f"algo.advantage={cfg.advantage} returned shape {tuple(advantages.shape)}; "
                         f"an estimator returns one advantage per token, [N, T] = {tuple(shape)}")
    if cfg.normalize_advantages:
        advantages = masked_whiten(advantages, mask)
    adv_flat = advantages[mask > 0]
    metrics["policy/advantage_mean"] = float(adv_flat.mean())
    metrics["policy/advantage_abs_mean"] = float(adv_flat.abs().mean())

    # 5. The actor.
    if train_actor:
        normalizer = loss_normalizer(mask, cfg.loss_agg, norm_length=cfg.loss_agg_length)
        actor_micros, actor_local = micros, local
        if skip_zero_advantage and registry.zero_advantage_rows_skippable(cfg):
            live = _rows_with_signal(advantages, mask)
            metrics["policy/zero_adv_skipped_frac"] = 1.0 - len(live) / len(trajectories)
            if len(live) < len(trajectories):
                actor_micros = _micro_batches(full, live, micro_batch_tokens, device)
                actor_local = actor.local_share(actor_micros)
        metrics.update(_train_actor(actor, actor_local, len(actor_micros), cfg, old, ref_lp, advantages,
                                    normalizer, trajectories, packed, temperature))
    metrics["micro_batches"] = float(len(micros))
    return metrics


def _rows_with_signal(advantages: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The rows with a non-zero advantage on some action token; when there is none, the shortest
    row, so that the optimizer still steps on a (zero) gradient as it would on the whole batch
    (AdamW moves the weights on its moments even then)."""
    live = ((advantages != 0) & (mask > 0)).any(dim=1)
    if bool(live.any()):
        return live.nonzero().squeeze(1).tolist()
    actions = mask.sum(dim=1)
    return [int(torch.where(actions > 0, actions, torch.full_like(actions, math.inf)).argmin())]


def _micro_batches(full: Batch, rows: list[int], micro_batch_tokens: int,
                   device: torch.device | str) -> list[_Micro]:
    """Rows `rows` of the batch `full` in micro-batches of at most `micro_batch_tokens` padded
    tokens (`micro_batch_indices`), on `device`."""
    lengths = full.attention_mask.sum(dim=1).tolist()
    groups = micro_batch_indices([lengths[r] for r in rows], micro_batch_tokens)
    return [_Micro(torch.tensor(picked), slice_batch(full, picked).to(device))
            for picked in ([rows[i] for i in group] for group in groups)]


def _check_loss(loss: torch.Tensor, what: str, m: _Micro, trajectories: list[Trajectory]) -> None:
    if not bool(torch.isfinite(loss.detach())):
        raise NonFiniteError(f"the {what} loss is {float(loss.detach())} on the micro-batch of tasks "
                             f"{_tasks(trajectories, m.rows.tolist())}; the weights were not updated. {_SKIP_FIX}")


def _train_critic(critic: Learner, micros: list[_Micro], cfg: AlgoConfig, values: torch.Tensor,
                  returns: torch.Tensor, mask: torch.Tensor, n_tokens: float,
                  trajectories: list[Trajectory]) -> dict[str, float]:
    """`cfg.critic_updates` critic optimizer steps towards `returns` (token-mean value loss)."""
    on = mask > 0
    metrics = {
        "value/explained_variance": explained_variance(values[on], returns[on],
                                                       torch.ones_like(values[on])),
        "value/mean": float(values[on].mean()),
        "value/return_mean": float(returns[on].mean()),
    }
    clip = cfg.value_clip if cfg.value_clip > 0 else None

    def loss_fn(m: _Micro) -> tuple[torch.Tensor, dict[str, float]]:
        v = token_values(critic.model, m.batch.input_ids, m.batch.attention_mask, m.batch.pixels)
        loss, out = value_loss(v, m.take(returns), m.batch.action_mask, n_tokens,
                               old_values=m.take(values) if clip else None, clip_eps=clip)
        _check_loss(loss, "critic", m, trajectories)
        return loss, out

    for k in range(cfg.critic_updates):
        with _finite_guard(critic, "critic", trajectories):
            cm = critic.step(micros, loss_fn)
        if k == 0:
            metrics["value/loss_first"] = cm["loss"]
        metrics["value/loss"] = cm["loss"]
        metrics["value/grad_norm"] = cm["grad_norm"]
    return metrics


def _train_actor(actor: Learner, micros: list[_Micro], n_micros: int, cfg: AlgoConfig, old: torch.Tensor,
                 ref_lp: torch.Tensor | None, advantages: torch.Tensor, normalizer: float,
                 trajectories: list[Trajectory], packed: bool | None, temperature: float) -> dict[str, float]:
    """`cfg.actor_updates` actor optimizer steps on the batch (`micros`: this process's share of
    the batch's `n_micros` micro-batches)."""
    policy_loss = registry.policy_loss_fn(cfg.policy_loss)
    kl_in_loss = ref_lp is not None and not cfg.kl_in_reward

    def loss_fn(m: _Micro) -> tuple[torch.Tensor, dict[str, float]]:
        b = m.batch
        lp, ent = _logprobs(actor.model, b, packed, temperature, with_entropy=True, entropy_grad=cfg.entropy_coef > 0)
        assert ent is not None
        token_loss, lm = policy_loss(PolicyLossInputs(
            lp, m.take(old), b.behavior_logprobs, m.take(advantages), b.action_mask), cfg)
        # A loss names its metrics as logged ("dis/masked_frac"); bare names go under policy/.
        out = {k if "/" in k else f"policy/{k}": v for k, v in lm.items()}
        loss = aggregate(token_loss, b.action_mask, cfg.loss_agg, normalizer)
        out["pg_loss"] = float(loss.detach())
        on = b.action_mask > 0
        n = max(float(on.sum()), 1.0)
        if kl_in_loss:
            assert ref_lp is not None
            kl = kl_estimate(lp, m.take(ref_lp), b.action_mask, cfg.kl_estimator, cfg.kl_k3_clamp)
            kl_term = aggregate(kl, b.action_mask, cfg.loss_agg, normalizer)
            loss = loss + cfg.kl_coef * kl_term
            out["kl_loss"] = float(kl_term.detach())
            out["kl/ref_kl_mean"] = float(kl.detach()[on].sum()) / n
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(ent, b.action_mask, cfg.loss_agg, normalizer)
        out["policy/entropy"] = float(ent.detach()[on].sum()) / n
        _check_loss(loss, "actor", m, trajectories)
        return loss, out

    metrics: dict[str, float] = {}
    for k in range(cfg.actor_updates):
        with _finite_guard(actor, "actor", trajectories):
            am = actor.step(micros, loss_fn)
        if k == 0:
            metrics["policy/loss_first"] = am["loss"]
        # Learner averages metrics over micro-batches; the loss terms are sums over them.
        for key in ("pg_loss", "kl_loss"):
            if key in am:
                metrics[f"policy/{key}"] = am.pop(key) * n_micros
        metrics.update(am)
    metrics["policy/loss"] = metrics.pop("loss")
    metrics["policy/grad_norm"] = metrics.pop("grad_norm")
    return metrics
