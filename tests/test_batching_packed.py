"""Packed batches: the layout by hand, and padded versus packed giving the same losses."""

from __future__ import annotations

import pytest
import torch

from tiderl.algos.aggregation import LOSS_AGG_MODES, aggregate, loss_normalizer
from tiderl.algos.policy_forward import critic_values, policy_logprobs
from tiderl.algos.policy_losses import (
    cispo_token_loss,
    decoupled_ppo_token_loss,
    dis_token_loss,
    gspo_token_loss,
    ppo_token_loss,
)
from tiderl.models.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.batching import (
    collate,
    pack_trajectories,
    packed_to_padded,
    padded_to_packed,
    plan_packed_rows,
)
from tiderl.train.critic import ValueModel
from tiderl.types import NO_VERSION, Trajectory


def traj(tokens: list[int], mask: list[int], reward: float = 0.0) -> Trajectory:
    lp = [-0.25 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    ver = [0 if m else NO_VERSION for m in mask]
    return Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=lp, policy_version=ver,
                      reward=reward)


A = traj([5, 6, 7], [0, 1, 1], 1.0)
B = traj([8, 9], [0, 1], 0.0)
C = traj([4, 4, 4, 4], [0, 0, 1, 1], 0.5)


def test_first_fit_decreasing_plan_by_hand() -> None:
    # Longest first: 7 (#4), 5 (#0), 4 (#2), 3 (#1), 2 (#3), rows of 8 tokens:
    # 7 -> row 0; 5 does not fit row 0 (12) -> row 1; 4 fits neither (11, 9) -> row 2;
    # 3 fits row 1 (5 + 3 = 8); 2 fits only row 2 (4 + 2 = 6).
    assert plan_packed_rows([5, 3, 4, 2, 7], 8) == [[4], [0, 1], [2, 3]]
    # A sequence longer than a row gets a row of its own.
    assert plan_packed_rows([10, 3], 8) == [[0], [1]]


def test_pack_trajectories_layout_by_hand() -> None:
    # Lengths A 3, B 2, C 4, rows of 6: C -> row 0; A does not fit (7) -> row 1; B fits row 0.
    p = pack_trajectories([A, B, C], pad_id=0, row_tokens=6)
    assert p.input_ids.tolist() == [[4, 4, 4, 4, 8, 9], [5, 6, 7, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]]
    assert p.seq_ids.tolist() == [[2, 2, 2, 2, 1, 1], [0, 0, 0, -1, -1, -1]]
    assert p.token_index.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, -1, -1, -1]]
    assert p.action_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert p.behavior_logprobs.tolist() == [[0, 0, -0.75, -1.0, 0, -0.5],
                                            [0, -0.5, -0.75, 0, 0, 0]]
    assert p.rewards.tolist() == [1.0, 0.0, 0.5]
    assert p.num_action_tokens.tolist() == [2, 1, 2]
    # Row 0's mask: C's 4 tokens see only C (causally), B's 2 tokens only B.
    m = p.attention_mask()[0, 0].int()
    assert m.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    # Row 1 trimmed to its used length.
    assert p.row(1).input_ids.tolist() == [[5, 6, 7]]


def test_padded_and_packed_layouts_map_onto_each_other() -> None:
    padded = collate([A, B, C], pad_id=0)
    p = pack_trajectories([A, B, C], pad_id=0, row_tokens=6)
    for name in ("input_ids", "action_mask", "behavior_logprobs"):
        moved = padded_to_packed(getattr(padded, name), p)
        valid = p.seq_ids >= 0
        assert torch.equal(moved[valid], getattr(p, name)[valid])
    back = packed_to_padded(p.behavior_logprobs, p, padded.input_ids.shape[1])
    assert torch.equal(back, padded.behavior_logprobs)


def _random_trajectories(n: int, seed: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 11, (1,), generator=g))
        mask = [0, 0] + (torch.rand(length - 2, generator=g) > 0.3).int().tolist()
        tokens = torch.randint(3, 50, (length,), generator=g).tolist()
        out.append(traj(tokens, mask, float(i % 2)))
    return out


LOSSES = {
    "ppo": lambda lp, old, beh, adv, m, seq: ppo_token_loss(lp, old, adv, m, 0.2, 0.28, 3.0),
    "decoupled_ppo": lambda lp, old, beh, adv, m, seq: decoupled_ppo_token_loss(
        lp, old, beh, adv, m, 0.2, 0.2, 2.0),
    "cispo": lambda lp, old, beh, adv, m, seq: cispo_token_loss(lp, old, adv, m, 1.0, 0.5),
    "dis": lambda lp, old, beh, adv, m, seq: dis_token_loss(lp, beh, adv, m, 0.3, 0.5),
    "gspo": lambda lp, old, beh, adv, m, seq: gspo_token_loss(lp, old, adv, m, 0.05, 0.05, seq),
}


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_padded_versus_packed_give_the_same_loss_and_gradient(loss_name: str) -> None:
    # Per-token log-probs, proximal log-probs and advantages laid out padded ([N, T], one row per
    # trajectory) and packed (several trajectories per row, through seq_ids): every aggregation
    # mode must give the same number and the same gradient on the underlying per-token tensor.
    trajs = _random_trajectories(7, seed=3)
    padded = collate(trajs, pad_id=0)
    packed = pack_trajectories(trajs, pad_id=0, row_tokens=16)
    assert packed.rows < len(trajs)  # rows really hold several trajectories
    g = torch.Generator().manual_seed(4)
    shape = padded.input_ids.shape
    beh = padded.behavior_logprobs.double()
    prox = beh + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    current = beh + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
    seq_adv = torch.randn(len(trajs), generator=g, dtype=torch.float64)
    adv = seq_adv.unsqueeze(1).expand(shape).clone()
    mask_pad = padded.action_mask.double()
    mask_pack = packed.action_mask.double()
    fn = LOSSES[loss_name]
    for mode in LOSS_AGG_MODES:
        norm_pad = loss_normalizer(mask_pad, mode, norm_length=12)
        norm_pack = loss_normalizer(mask_pack, mode, packed.seq_ids, norm_length=12)
        assert norm_pad == norm_pack
        a = current.clone().requires_grad_(True)
        tl, _ = fn(a, prox, beh, adv, mask_pad, None)
        loss_pad = aggregate(tl, mask_pad, mode, norm_pad)
        loss_pad.backward()
        b = current.clone().requires_grad_(True)
        to = lambda x: padded_to_packed(x, packed)  # noqa: E731
        tl, _ = fn(to(b), to(prox), to(beh), to(adv), mask_pack, packed.seq_ids)
        loss_pack = aggregate(tl, mask_pack, mode, norm_pack, packed.seq_ids)
        loss_pack.backward()
        assert loss_pack.item() == pytest.approx(loss_pad.item(), abs=1e-12), mode
        assert torch.allclose(a.grad, b.grad, atol=1e-12), mode


def test_packed_model_forward_matches_padded() -> None:
    # The block-diagonal mask and restarting positions make each trajectory in a packed row see
    # exactly what it sees alone: log-probs, entropies and critic values agree with the padded
    # forward. (RoPE only sees position differences, but the mask is what keeps trajectories
    # apart: without it, later trajectories would attend to earlier ones.)
    cfg = tiny_qwen2_config(50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            max_position_embeddings=64)
    model = init_tiny_model(cfg, seed=0)
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    trajs = _random_trajectories(5, seed=5)
    padded = collate(trajs, pad_id=0)
    packed = pack_trajectories(trajs, pad_id=0, row_tokens=20)
    with torch.no_grad():
        lp_pad, ent_pad = policy_logprobs(model, padded.input_ids, padded.attention_mask,
                                          entropy="detached")
        lp_pack, ent_pack = policy_logprobs(model, packed.input_ids, packed.attention_mask(),
                                            packed.position_ids, entropy="detached")
        v_pad = critic_values(critic, padded.input_ids, padded.attention_mask)
        v_pack = critic_values(critic, packed.input_ids, packed.attention_mask(),
                               packed.position_ids)
    width = padded.input_ids.shape[1]
    on = padded.attention_mask > 0
    for pad, pack in ((lp_pad, lp_pack), (ent_pad, ent_pack), (v_pad, v_pack)):
        assert pad is not None and pack is not None
        back = packed_to_padded(pack, packed, width)
        assert torch.allclose(back[on], pad[on], atol=1e-5)
    # Position 0 of every trajectory holds 0 in both layouts.
    assert (packed_to_padded(lp_pack, packed, width)[:, 0] == 0).all()
    # Without the block mask the second trajectory of a row would see the first one.
    with torch.no_grad():
        leaky, _ = policy_logprobs(model, packed.input_ids, torch.ones_like(packed.input_ids))
    assert not torch.allclose(packed_to_padded(leaky, packed, width)[on], lp_pad[on], atol=1e-3)
