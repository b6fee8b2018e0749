"""The trainer's speed parts: packed micro-batches (the layout; a packed forward/backward gives
the padded path's log-probs, entropies, gradients and optimizer step), the fused AdamW step and
the batched finite-gradient guard."""

import copy
import random

import pytest
import torch

from tiderl.config import load_config
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.batching import collate, pack
from tiderl.train.forward import packed_token_logprobs, packs, token_logprobs
from tiderl.train.learner import Learner
from tiderl.train.step import train_step
from tiderl.types import NO_VERSION, Trajectory


def traj(tokens, mask, reward=1.0, group="g"):
    return Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=[-0.7 if m else 0.0 for m in mask],
                      policy_version=[0 if m else NO_VERSION for m in mask], reward=reward, group_id=group,
                      task_id=group)


def random_trajectories(n, seed, vocab=60):
    """Sequences of different lengths, a prompt then a completion, two groups."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(2, 12), rng.randint(1, 14)
        out.append(traj([rng.randrange(3, vocab) for _ in range(p + c)], [0] * p + [1] * c,
                        reward=float(rng.random() < 0.5), group=f"g{i % 2}"))
    return out


@pytest.fixture(scope="module")
def model():
    # Grouped-query attention (4 query heads, 2 KV heads), two layers.
    return init_tiny_model(tiny_qwen2_config(60, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                             max_position_embeddings=64), seed=0)


def test_pack_layout():
    b = collate([traj([5, 6, 7], [0, 1, 1]), traj([8, 9], [0, 1]), traj([4, 3, 2, 1], [0, 0, 1, 0])], pad_id=0)
    p = pack(b.input_ids, b.attention_mask, b.action_mask)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 3, 2, 1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]  # restart with every sequence
    # Padded layout again: row 1's padding points at its first token (packed index 3).
    assert p.gather.tolist() == [[0, 1, 2, 0], [3, 4, 3, 3], [5, 6, 7, 8]]
    # Scored tokens (action mask 1, not position 0) and the packed position predicting each.
    assert list(zip(p.keep_rows.tolist(), p.keep_cols.tolist())) == [(0, 1), (0, 2), (1, 1), (2, 2)]
    assert p.keep.tolist() == [0, 1, 3, 6]


def grouped_trajectories(seed, vocab=60):
    """Two prompts with four completions each (a GRPO batch), a row whose prompt leaves the first
    prompt halfway, and two completions that begin alike: prefixes shared to different depths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(6, 12))] for _ in range(2)]
    out = []
    for i in range(8):
        prompt = prompts[i % 2]
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
        if i == 5:
            completion = out[1].tokens[len(prompt):][:3] + completion  # begins as row 1's did
        out.append(traj(prompt + completion, [0] * len(prompt) + [1] * len(completion), float(i % 3 == 0),
                        group=f"g{i % 2}"))
    half = prompts[0][:4] + [rng.randrange(3, vocab) for _ in range(5)]
    out.append(traj(half + [5, 6], [0] * len(half) + [1, 1], group="g2"))
    return out


def test_pack_holds_a_shared_prefix_once():
    b = collate([traj([5, 6, 7, 8], [0, 0, 1, 1]), traj([5, 6, 9], [0, 0, 1]), traj([4, 6], [0, 1]),
                 traj([5, 6, 7, 1], [0, 0, 1, 1])], pad_id=0)
    p = pack(b.input_ids, b.attention_mask, b.action_mask)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 6, 1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 3]]
    # Rows 1 and 3 read the shared tokens from row 0's copy.
    assert p.gather.tolist() == [[0, 1, 2, 3], [0, 1, 4, 0], [5, 6, 5, 5], [0, 1, 2, 7]]
    # Row 3's first scored token (7, column 2) is predicted from row 0's copy of token 6.
    assert list(zip(p.keep_rows.tolist(), p.keep_cols.tolist())) == [(0, 2), (0, 3), (1, 2), (2, 1), (3, 2),
                                                                      (3, 3)]
    assert p.keep.tolist() == [1, 2, 1, 5, 1, 2]
    whole = pack(b.input_ids, b.attention_mask, b.action_mask, share_prefixes=False)
    assert whole.input_ids.shape[1] == int(b.attention_mask.sum()) == 13


@pytest.mark.parametrize("batch", ["random", "shared prompts"])
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_path(model, batch):
    trajectories = random_trajectories(7, seed=1) if batch == "random" else grouped_trajectories(seed=3)
    b = collate(trajectories, pad_id=0)
    if batch == "shared prompts":  # the packed row is much shorter than the real tokens
        assert pack(b.input_ids, b.attention_mask, b.action_mask).input_ids.shape[1] < 0.7 * int(
            b.attention_mask.sum())
    on = b.action_mask > 0
    assert int(b.attention_mask.sum()) < b.attention_mask.numel()  # there is padding to leave out

    def run(fn, *extra):
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, b.input_ids, b.attention_mask, *extra, with_entropy=True, entropy_grad=True)
        ((lp * b.action_mask).sum() + 0.1 * (ent * b.action_mask).sum()).backward()
        return lp, ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    lp, ent, grads = run(token_logprobs)
    plp, pent, pgrads = run(packed_token_logprobs, b.action_mask)
    assert model.config._attn_implementation == "sdpa"  # restored after the packed pass
    torch.testing.assert_close(plp[on], lp[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pent[on], ent[on], atol=1e-5, rtol=1e-5)
    assert float(plp.detach()[~on].abs().max()) == 0.0 and float(pent.detach()[~on].abs().max()) == 0.0
    for name, g in grads.items():
        torch.testing.assert_close(pgrads[name], g, atol=1e-6, rtol=1e-4, msg=f"gradient of {name}")
    # Attention does not cross sequences: changing one sequence leaves the others' log-probs alone.
    changed = b.input_ids.clone()
    changed[0, : int(b.attention_mask[0].sum())] = 7
    with torch.no_grad():
        again, _ = packed_token_logprobs(model, changed, b.attention_mask, b.action_mask)
    torch.testing.assert_close(again[1:], plp.detach()[1:], atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["random", "shared prompts"])
def test_train_step_packed_equals_padded(model, batch):
    cfg = load_config(None, ["algo.name=grpo", "algo.kl_coef=0.0", "algo.loss_agg=token-mean",
                             "algo.group_size=4"]).algo
    batch = random_trajectories(8, seed=2) if batch == "random" else grouped_trajectories(seed=4)[:8]
    results = {}
    for packed in (False, True):
        learner = Learner(copy.deepcopy(model), lr=1e-2)
        metrics = train_step(batch, learner, None, None, cfg, pad_id=0, micro_batch_tokens=40, train_actor=True,
                             packed=packed)
        results[packed] = (metrics, {n: p.detach().clone() for n, p in learner.model.named_parameters()})
    (m0, w0), (m1, w1) = results[False], results[True]
    assert m0["micro_batches"] == m1["micro_batches"] > 1
    for key in ("policy/loss", "policy/grad_norm", "policy/entropy", "policy/clip_frac"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    # AdamW's first step moves an element by lr * g / (|g| + eps): where |g| is near eps (1e-8),
    # the summation order of packed and padded batches shows in the update (measured: one
    # element in 4,096 off by 1.6e-6 on an AVX-512 CPU). 1e-5 is 0.1 % of lr.
    for name, w in w0.items():
        torch.testing.assert_close(w1[name], w, atol=1e-5, rtol=1e-5, msg=f"weights {name} after the step")


def test_packs_only_plain_full_attention_models(model):
    assert packs(model)
    sliding = copy.deepcopy(model)
    sliding.config.use_sliding_window, sliding.config.sliding_window = True, 4
    assert not packs(sliding)
    assert not packs(torch.nn.Linear(2, 2))  # not a Hugging Face model: the padded path


@pytest.mark.slow
def test_learner_uses_fused_adamw_with_the_default_update(model):
    fused = Learner(copy.deepcopy(model), lr=1e-2, weight_decay=0.1)
    assert fused.optimizer.param_groups[0]["fused"] is True
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    for _ in range(3):
        for m, opt in ((fused.model, fused.optimizer), (plain_model, plain)):
            opt.zero_grad()
            m(input_ids=ids).logits.square().mean().backward()
            opt.step()
    # The k_proj bias gets a gradient of rounding noise only (a key bias shifts every score of a
    # query alike, which softmax ignores), so Adam's normalised step of it depends on how each
    # implementation rounds (1.4e-6 apart on an AVX-512 CPU). 1e-5 is 0.1 % of lr.
    for (name, a), b in zip(fused.model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_finite_guard_refuses_one_bad_gradient_element(model, bad):
    from tiderl.train.step import NonFiniteError, _finite_guard

    learner = Learner(copy.deepcopy(model), lr=1e-2)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    for p in learner.params:
        p.grad = torch.full_like(p, 1e-3)
    with _finite_guard(learner, "actor", [traj([1, 2], [0, 1])]):
        learner.optimizer.step()  # every gradient finite: the step happens
    assert any(not torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    stepped = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    learner.params[-1].grad.view(-1)[5] = bad
    with pytest.raises(NonFiniteError, match="actor gradient is non-finite"), \
            _finite_guard(learner, "actor", [traj([1, 2], [0, 1])]):
        learner.optimizer.step()
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, stepped[n]), f"{n} changed although a gradient was {bad}"
