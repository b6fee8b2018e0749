"""Value pretraining: Monte-Carlo targets by hand, a fit that improves on held-out trajectories,
the CLI writing a critic that `algo.value_init` loads."""

from __future__ import annotations

import json

import pytest
import torch

from tiderl.train.value_pretrain import load_trajectories, monte_carlo_returns, save_trajectories
from tiderl.types import Trajectory


def test_monte_carlo_returns_skip_observations_and_discount_over_model_tokens():
    # Tokens: [prompt, a, a, obs, obs, a] with reward 1 and gamma 0.5. Over action tokens only,
    # the last action token gets 1, the one before 0.5, the first 0.25; observations get 0.
    mask = torch.tensor([[0, 1, 1, 0, 0, 1.0]])
    returns = monte_carlo_returns(torch.tensor([1.0]), mask, gamma=0.5)
    assert torch.allclose(returns * mask, torch.tensor([[0, 0.25, 0.5, 0, 0, 1.0]]))
    assert torch.allclose(monte_carlo_returns(torch.tensor([2.0]), mask) * mask,
                          torch.tensor([[0, 2, 2, 0, 0, 2.0]]))  # gamma 1: the outcome everywhere


def test_trajectory_files_round_trip_and_bad_lines_name_their_number(tmp_path):
    t = Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 3, 3], reward=1.0, task_id="a",
                   annotations={"values": [0.0, 0.1, 0.2]})
    path = tmp_path / "t.jsonl"
    assert save_trajectories([t, t], path) == 2
    assert load_trajectories(path) == [t, t]
    path.write_text(path.read_text() + '{"tokens": [1]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:3 is not a tiderl trajectory"):
        load_trajectories(path)


@pytest.mark.slow
def test_pretrain_value_cli_fits_returns_and_writes_a_loadable_critic(cache, tmp_path):
    from support import SMALL
    from tiderl.cli import main
    from tiderl.config import load_config
    from tiderl.run import build_run

    common = SMALL + [f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}",
                      "algo.critic_lr=2e-3", "algo.normalize_advantages=false",
                      "algo.freeze_critic_attention=false"]
    out = tmp_path / "critic"
    assert main(["pretrain-value", "--config", "configs/kg_sao_tiny.yaml", "--episodes", "192",
                 "--epochs", "1", "--out", str(out), *common]) == 0
    report = json.loads((out / "pretrain_report.json").read_text())
    assert report["holdout"] == 19 and report["train"] == 173 and report["steps"] == 22  # batch 8
    data = load_trajectories(out / "trajectories.jsonl")
    assert len(data) == 192

    # A barely warm-started policy solves almost nothing, so give the returns a signal the
    # critic can read off the prompt: 1-hop questions "succeed", 2-hop ones do not.
    for t in data:
        t.reward = 1.0 if t.task_id.startswith("kgsyn-1-") else 0.0
    assert 0 < sum(t.reward for t in data) < len(data)
    save_trajectories(data, tmp_path / "labelled.jsonl")
    assert main(["pretrain-value", "--config", "configs/kg_sao_tiny.yaml", "--trajectories",
                 str(tmp_path / "labelled.jsonl"), "--epochs", "8", "--out", str(out), *common]) == 0
    report = json.loads((out / "pretrain_report.json").read_text())
    # A zero-head critic predicts 0 everywhere; the fitted one explains part of the returns.
    assert report["after"]["mse"] < report["before"]["mse"]
    assert report["after"]["explained_variance"] > 0.02  # 0.075 measured: more than the mean

    run = build_run(load_config("configs/kg_sao_tiny.yaml", common + [f"algo.value_init={out}"]))
    head = run.critic.model.head.weight.detach()
    assert float(head.abs().sum()) > 0  # loaded, not the zero-initialised head
