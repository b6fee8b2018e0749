"""`tiderl simulate --config`: a run config (the cluster recipe) turned into the simulator's
settings by tiderl/lab/cluster_model.py's rules, and the recipe's predicted step time printed."""

from __future__ import annotations

import argparse
import json

import pytest

from tiderl.cli import _parser, main
from tiderl.config import load_config
from tiderl.lab import cluster_model as cm

RECIPE = "configs/cluster_qwen7b_sao.yaml"


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["simulate", *argv])


def test_the_recipe_sets_servers_ranks_batch_and_the_stale_policy():
    from tiderl.lab import simulate_cli

    args = _args("--config", RECIPE, "--params", "7.6e9", "--gpu", "h100")
    workload, cluster, schedule = simulate_cli.settings(args)
    cfg = load_config(RECIPE)
    assert cluster.engines == len(cfg.rollout.options.urls) == 8
    assert (schedule.batch_size, schedule.steps) == (512, 200)
    assert args.staleness == (2,) and args.stale_policies == (("mask", 2, True),)
    names = [m.name for m in simulate_cli.modes_of(args, schedule)]
    assert "async-s2-mask+2-drain" in names and "sync" in names
    # A flag still overrides what the config gives.
    assert simulate_cli.settings(_args("--config", RECIPE, "--params", "7.6e9", "--engines", "3"))[1].engines == 3


def test_the_cost_rules_scale_as_documented():
    cfg = load_config(RECIPE)
    shape = cm.ModelShape.from_params(7.6e9)
    base = cm.cluster_from_config(cfg, "h100", shape)
    twice = cm.cluster_from_config(load_config(RECIPE, ["train.world_size=16"]), "h100", shape)
    assert twice.train_s_per_token == pytest.approx(base.train_s_per_token / 2)  # twice the ranks
    h200 = cm.cluster_from_config(cfg, "h200", shape)
    assert h200.decode_step_s == pytest.approx(base.decode_step_s * 3.35 / 4.8)  # decode reads the weights
    assert h200.train_s_per_token == pytest.approx(base.train_s_per_token)  # same peak FLOP/s
    # SAO trains a critic (K=2 updates and a value pass) beside the policy: (6 + 6*2 + 2) P per token.
    assert cm.train_flops_per_token(cfg, 1.0) == 20.0
    grpo = load_config(RECIPE, ["algo.name=grpo", "algo.group_size=8", "algo.critic_warmup_steps=0"])
    assert grpo.algo.kl_coef > 0 and cm.train_flops_per_token(grpo, 1.0) == 8.0  # no critic; a reference pass
    assert cm.train_flops_per_token(load_config(RECIPE, ["algo.name=grpo", "algo.group_size=8", "algo.kl_coef=0",
                                                         "algo.critic_warmup_steps=0"]), 1.0) == 6.0
    assert base.sync_s == pytest.approx(2 * 2 * 7.6e9 / 2e9)  # bf16 weights written and read at 2 GB/s


def test_the_size_comes_from_the_models_config_json(tmp_path):
    hf = {"hidden_size": 3584, "num_hidden_layers": 28, "vocab_size": 152064, "num_attention_heads": 28,
          "num_key_value_heads": 4, "intermediate_size": 18944, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shape = cm.model_shape(load_config(RECIPE, [f"model.path={tmp_path}"]), None)
    assert 7.5e9 < shape.params < 7.7e9  # Qwen2.5-7B's 7.6B (biases left out)
    assert shape.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    with pytest.raises(ValueError, match="--params"):
        cm.model_shape(load_config(RECIPE, [f"model.path={tmp_path / 'absent'}"]), None)


def test_simulate_prints_the_recipes_predicted_step(capsys):
    rc = main(["simulate", "--config", RECIPE, "--params", "7.6e9", "--seeds", "1", "--steps", "3",
               "--batch-size", "32", "--engines", "2", "--cancel-factors", "none", "--sync-batch-factor", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "scenario agentic-cluster" in out
    assert f"recipe {RECIPE} on h100 (7.6B parameters) runs async-s2-mask+2-drain: predicted step" in out


def test_a_bad_recipe_flag_names_it(capsys):
    assert main(["simulate", "--config", RECIPE, "--params", "7.6e9", "--mfu", "0"]) == 2
    assert "--mfu 0" in capsys.readouterr().err
    assert main(["simulate", "--config", RECIPE, "--params", "7.6e9", "--gpu", "tpu"]) == 2
    assert "--gpu 'tpu': use one of a100, h100, h200" in capsys.readouterr().err
