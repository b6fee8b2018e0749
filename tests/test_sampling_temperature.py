"""Rollouts sampled below temperature 1: the trainer scores tokens at the rollouts' temperature,
as the engine's behaviour log-probs are, so SAO's ratio is 1 on fresh data instead of masked."""

import pytest
import torch

from support import rollout, small_config
from tiderl.recipe import train
from tiderl.run import build_run
from tiderl.train.batching import collate
from tiderl.train.forward import logprob_temperature, packed_token_logprobs, token_logprobs

pytestmark = pytest.mark.slow


def test_logprob_temperature_of_greedy_rollouts_is_one():
    assert logprob_temperature(0.0) == 1.0
    assert logprob_temperature(0.7) == 0.7
    assert logprob_temperature(1.0) == 1.0


def test_scoring_refuses_a_zero_temperature():
    def model(**kwargs):
        return type("Output", (), {"logits": torch.zeros(1, 3, 5)})()

    with pytest.raises(ValueError, match="logprob_temperature"):
        token_logprobs(model, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), temperature=0.0)


def test_trainer_recompute_matches_engine_at_the_sampling_temperature(cache, tmp_path):
    run = build_run(small_config(cache, tmp_path / "run", "rollout.temperature=0.7"))
    trajectories = rollout(run, run.tasks.take(8))
    batch = collate(trajectories, run.tokenizer.pad_token_id)
    mask = batch.action_mask > 0
    model = run.actor.model.eval()
    with torch.no_grad():
        at_07, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7)
        at_1, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        packed, _ = packed_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask,
                                          temperature=0.7)
    behaviour = batch.behavior_logprobs[mask]
    assert (at_07[mask] - behaviour).abs().max().item() < 1e-4
    assert (packed[mask] - at_07[mask]).abs().max().item() < 1e-4
    # Scored at temperature 1 instead, the same tokens are far off: this is what the trainer did.
    assert (at_1[mask] - behaviour).abs().max().item() > 0.1


def test_sao_steps_at_temperature_07_mask_no_fresh_token(cache, tmp_path):
    """On-policy (system.max_staleness=0), every trained token was sampled by the weights that
    train on it, so the ratio is 1 and SAO's double-sided mask keeps every token."""
    cfg = small_config(cache, tmp_path / "run", "rollout.temperature=0.7", "train.steps=2",
                       "algo.critic_warmup_steps=0")
    history, _ = train(build_run(cfg))
    assert len(history) == 2
    for h in history:
        assert h["dis/masked_frac"] == 0.0
        assert abs(h["dis/ratio_max"] - 1.0) < 1e-4 and abs(h["dis/ratio_min"] - 1.0) < 1e-4
