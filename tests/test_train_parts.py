"""Trainer parts: batching, micro-batches, forward alignment, the critic, the learner."""

import pytest
import torch

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.batching import collate, micro_batch_indices, slice_batch
from tiderl.train.critic import ValueModel, freeze_matching
from tiderl.train.forward import token_logprobs, token_values
from tiderl.train.learner import Learner
from tiderl.types import NO_VERSION, Trajectory


def traj(tokens, mask, reward=1.0):
    lp = [-0.5 if m else 0.0 for m in mask]
    ver = [0 if m else NO_VERSION for m in mask]
    return Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=lp, policy_version=ver,
                      reward=reward)


@pytest.fixture(scope="module")
def model():
    return init_tiny_model(tiny_qwen2_config(50, hidden_size=32, num_layers=1, num_heads=2,
                                             num_kv_heads=1, max_position_embeddings=64), seed=0)


def test_trajectory_rejects_misaligned_fields():
    with pytest.raises(ValueError, match="loss_mask has length 2, tokens has 3"):
        Trajectory(tokens=[1, 2, 3], loss_mask=[0, 1], behavior_logprobs=[0, 0, 0],
                   policy_version=[0, 0, 0])


def test_collate_pads_right_and_masks():
    b = collate([traj([5, 6, 7], [0, 1, 1], 1.0), traj([5, 6], [0, 1], 0.0)], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [5, 6, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b.action_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert b.behavior_logprobs.tolist() == [[0, -0.5, -0.5], [0, -0.5, 0]]
    assert b.rewards.tolist() == [1.0, 0.0]
    assert b.num_action_tokens.tolist() == [2, 1]
    s = slice_batch(b, [1])
    assert s.input_ids.tolist() == [[5, 6]]  # trimmed to its own length


def test_micro_batches_respect_the_budget_and_cover_every_index():
    lengths = [10, 3, 7, 8, 2, 9]
    groups = micro_batch_indices(lengths, token_budget=16)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 16
    # Sorted by length: [2, 3] | [7, 8] | [9] | [10] (2*8=16 fits, 3*8 does not).
    assert groups == [[4, 1], [2, 3], [5], [0]]
    # A sequence longer than the budget still gets its own micro-batch.
    assert micro_batch_indices([40, 5], token_budget=16) == [[1], [0]]


def test_token_logprobs_align_with_tokens(model):
    ids = torch.tensor([[3, 9, 4, 1]])
    lp, ent = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True)
    logits = model(input_ids=ids).logits[0].float()
    # Position t holds log p(token t | tokens < t): row t-1 of the logits.
    expected = torch.log_softmax(logits, -1)[torch.arange(3), ids[0, 1:]]
    assert lp[0, 0] == 0
    assert torch.allclose(lp[0, 1:], expected, atol=1e-5)
    assert (ent[0, 1:] > 0).all() and not ent.requires_grad
    # entropy_grad: the same entropies, differentiable (an entropy bonus trains through them).
    _, ent_grad = token_logprobs(model, ids, torch.ones_like(ids), entropy_grad=True)
    assert ent_grad.requires_grad and torch.allclose(ent_grad, ent)


def test_right_padding_does_not_change_logprobs(model):
    ids = torch.tensor([[3, 9, 4, 1], [3, 9, 0, 0]])
    am = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    lp, _ = token_logprobs(model, ids, am)
    alone, _ = token_logprobs(model, ids[1:, :2], am[1:, :2])
    assert torch.allclose(lp[1, :2], alone[0], atol=1e-5)


def test_critic_starts_from_the_policy_and_predicts_zero(model):
    critic = ValueModel.from_policy(model)
    ids = torch.tensor([[3, 9, 4]])
    v = token_values(critic, ids, torch.ones_like(ids))
    assert v.shape == (1, 3) and torch.all(v == 0)
    # Same backbone weights as the policy, but a separate copy.
    emb_p = model.get_input_embeddings().weight
    emb_c = critic.backbone.get_input_embeddings().weight
    assert torch.equal(emb_p, emb_c) and emb_p.data_ptr() != emb_c.data_ptr()


def test_freeze_attention_and_fail_loudly(model):
    critic = ValueModel.from_policy(model)
    frozen = freeze_matching(critic, r"self_attn\.")
    assert frozen and all("self_attn" in n for n in frozen)
    trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert "head.weight" in trainable and any("mlp" in n for n in trainable)
    assert not any("self_attn" in n for n in trainable)
    with pytest.raises(ValueError, match="matched no parameter"):
        freeze_matching(critic, r"attention_does_not_exist")


def test_critic_save_load_roundtrip(model, tmp_path):
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.head.weight)
    critic.save(tmp_path / "c")
    again = ValueModel.load(tmp_path / "c")
    ids = torch.tensor([[3, 9, 4]])
    assert torch.allclose(critic(ids, torch.ones_like(ids)), again(ids, torch.ones_like(ids)))
    with pytest.raises(FileNotFoundError, match="algo.value_init"):
        ValueModel.load(tmp_path)


def test_critic_head_stays_float32_on_a_bfloat16_backbone(model, tmp_path):
    """A bf16 critic keeps an fp32 head: a step of 1e-4 on a bias of 0.05 must not round away."""
    critic = ValueModel.from_policy(init_tiny_model(model.config, seed=0).to(torch.bfloat16))
    assert next(critic.backbone.parameters()).dtype == torch.bfloat16
    assert critic.head.weight.dtype == critic.head.bias.dtype == torch.float32
    ids = torch.tensor([[3, 9, 4]])
    assert critic(ids, torch.ones_like(ids)).dtype == torch.float32
    with torch.no_grad():
        critic.head.bias.fill_(0.05)
        critic.head.bias -= 1e-4
    assert critic.head.bias.item() == pytest.approx(0.0499, abs=1e-7)
    assert torch.tensor(0.05, dtype=torch.bfloat16) - 1e-4 == torch.tensor(0.05, dtype=torch.bfloat16)
    critic.save(tmp_path / "c")
    again = ValueModel.load(tmp_path / "c", dtype=torch.bfloat16)
    assert again.head.bias.dtype == torch.float32 and again.head.bias.item() == critic.head.bias.item()


def test_learner_micro_batches_match_one_batch(model):
    """Accumulating two normalised micro-batches gives the full batch's gradient."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (4, 6))
    am = torch.ones_like(ids)

    def grads(splits):
        m = init_tiny_model(model.config, seed=0)
        learner = Learner(m, lr=0.0)
        total = float(am[:, 1:].sum())

        def loss_fn(rows):
            lp, _ = token_logprobs(m, ids[rows], am[rows])
            return -lp.sum() / total, {}

        learner.step(splits, loss_fn)
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    g_one = grads([[0, 1, 2, 3]])
    g_two = grads([[0, 1], [2, 3]])
    assert torch.allclose(g_one, g_two, atol=1e-6)


def test_weight_sync_is_verified(model):
    from types import SimpleNamespace

    from tiderl.run import sync_weights
    from tiderl.rollout.torch_engine import TorchEngine

    actor = Learner(init_tiny_model(model.config, seed=1), lr=1e-3)
    engine = TorchEngine(model, tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=2))
    run = SimpleNamespace(actor=actor, engine=engine, step=1)
    sync_weights(run)
    assert engine.version == 1
    for k, v in actor.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], v)

    # An engine that drops the weights it is sent is caught, naming the version.
    engine.update_weights = lambda state, version: None
    with torch.no_grad():
        next(actor.model.parameters()).add_(1.0)
    run.step = 2
    with pytest.raises(RuntimeError, match="weight sync to version 2 failed"):
        sync_weights(run)
