"""Algorithm presets and the algo.* config checks."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tiderl.algos.presets import PRESETS, TRAINER_KEYS
from tiderl.config import (
    AlgoConfig,
    ConfigError,
    RunConfig,
    algorithm_keys,
    config_from_dict,
    load_config,
    preset_defaults,
    with_preset,
)

NAMES = sorted(PRESETS)


def test_every_name_has_a_preset_and_every_preset_validates() -> None:
    choices = dataclasses.fields(AlgoConfig)[0].metadata["choices"]
    assert sorted(choices) == NAMES
    for name in NAMES:
        cfg = config_from_dict({"algo": {"name": name}})
        assert cfg.algo.name == name


def test_sao_preset_is_the_defaults() -> None:
    # The AlgoConfig defaults are SAO's, so applying the sao preset changes nothing (existing
    # configs keep their meaning).
    assert AlgoConfig(**preset_defaults("sao")) == AlgoConfig()


def test_presets_set_every_algorithm_key_and_no_trainer_key() -> None:
    keys = set(algorithm_keys()) | {"name"}
    for name in NAMES:
        d = preset_defaults(name)
        assert set(d) == keys, name
        assert not set(PRESETS[name]) & set(TRAINER_KEYS), name


@pytest.mark.parametrize("a, b", list(itertools.combinations(NAMES, 2)))
def test_switching_preset_changes_only_algorithm_options(a: str, b: str) -> None:
    # The same user config (trainer options set explicitly) under two presets: everything
    # outside algo.*, and the trainer keys inside it, stay identical.
    user = {"train": {"steps": 7, "micro_batch_tokens": 8192}, "rollout": {"batch_size": 64},
            "model": {"device": "cpu"}}
    algo_user = {"actor_lr": 3e-5}
    cfg_a = config_from_dict({**user, "algo": {"name": a, **algo_user}})
    cfg_b = config_from_dict({**user, "algo": {"name": b, **algo_user}})
    da, db = dataclasses.asdict(cfg_a), dataclasses.asdict(cfg_b)
    assert {k: v for k, v in da.items() if k != "algo"} == {
        k: v for k, v in db.items() if k != "algo"}
    changed = {k for k in da["algo"] if da["algo"][k] != db["algo"][k]}
    assert "name" in changed and changed <= set(algorithm_keys()) | {"name"}
    assert all(da["algo"][k] == db["algo"][k] for k in TRAINER_KEYS)


def test_user_keys_win_over_the_preset() -> None:
    d = with_preset({"name": "grpo", "kl_coef": 0.0, "group_size": 4})
    assert d["kl_coef"] == 0.0 and d["group_size"] == 4
    assert d["advantage"] == "grpo" and d["loss_agg"] == "seq-mean-token-mean"
    assert with_preset({}) == preset_defaults("sao")
    with pytest.raises(ValueError, match="unknown algorithm preset 'grpoo'"):
        preset_defaults("grpoo")


def test_preset_values_by_paper() -> None:
    # A few values each paper fixes (docs/algorithms.md): DAPO's clip-higher (0.2, 0.28);
    # GSPO's (3e-4, 4e-4); GRPO's KL beta 0.04 with k3; CISPO without a lower bound.
    assert (preset_defaults("dapo")["eps_low"], preset_defaults("dapo")["eps_high"]) == (0.2, 0.28)
    assert (preset_defaults("gspo")["eps_low"], preset_defaults("gspo")["eps_high"]) == (3e-4, 4e-4)
    assert (preset_defaults("grpo")["kl_coef"], preset_defaults("grpo")["kl_estimator"]) == (
        0.04, "k3")
    assert preset_defaults("cispo")["eps_low"] == 1.0
    # Critic-free presets never wait for a critic warm-up.
    for name in NAMES:
        d = preset_defaults(name)
        if d["advantage"] != "gae":
            assert d["critic_warmup_steps"] == 0, name


@pytest.mark.parametrize("overrides, field, fix", [
    # A key that the chosen algorithm does not read is rejected, not silently ignored.
    (["algo.name=grpo", "algo.critic_lr=1e-3"], "algo.critic_lr", "remove algo.critic_lr"),
    (["algo.kl_estimator=k1"], "algo.kl_estimator", "remove algo.kl_estimator"),
    (["algo.advantage=gea"], "algo.advantage", "use one of gae"),
    (["algo.name=grpo", "algo.group_size=1"], "algo.group_size", "use e.g. 8"),
    (["algo.name=dapo", "algo.advantage=reinforce_pp", "algo.group_size=1"], "algo.dynamic_sampling",
     "algo.group_size >= 2"),
    (["algo.name=grpo", "algo.advantage=grpo", "algo.group_size=5"], "algo.group_size",
     "multiple of algo.group_size"),
    (["algo.name=ppo", "algo.policy_loss=ppo", "algo.dual_clip_c=0.5"], "algo.dual_clip_c",
     "use 3.0"),
    (["algo.name=ppo", "algo.policy_loss=cispo", "algo.dual_clip_c=3"], "algo.dual_clip_c",
     "remove algo.dual_clip_c"),
    (["algo.name=ppo", "algo.loss_agg=seq-mean-token-sum-norm"], "algo.loss_agg_length",
     "generation budget"),
    (["algo.name=ppo", "algo.overlong_buffer=16"], "algo.overlong_max_tokens",
     "action-token limit"),
    (["algo.name=ppo", "algo.behavior_weight_cap=0.5"], "algo.behavior_weight_cap", "5.0"),
    (["algo.eps_low=1.5"], "algo.eps_low", "0.3"),
])
def test_algo_errors_name_the_field_and_the_fix(overrides, field, fix) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert msg.startswith(field) and "Fix:" in msg and fix in msg


def test_choices_are_checked() -> None:
    with pytest.raises(ConfigError, match="algo.loss_agg: 'mean' is not one of"):
        load_config(None, ["algo.loss_agg=mean"])
    with pytest.raises(ConfigError, match="algo.name: unknown algorithm 'trpo'. Fix: use one of sao, ppo"):
        load_config(None, ["algo.name=trpo"])
    # eps_low = 1 (no lower bound) is allowed now, for CISPO.
    assert isinstance(load_config(None, ["algo.eps_low=1.0"]), RunConfig)


def test_presets_import_without_torch_and_exports_resolve() -> None:
    # config.py must not import torch, so the config loader can apply presets only if
    # tiderl.algos.presets (and the package init) stay torch-free.
    import subprocess
    import sys

    code = ("import sys, tiderl.config as c; c.with_preset({'name': 'grpo'}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- which algo.* keys a run leaves unread: derived from what the chosen parts declare -------------


@pytest.mark.parametrize("overrides, key, reason", [
    (["algo.adv_eps=0.1"], "algo.adv_eps", "only algo.advantage=grpo reads it"),
    (["algo.name=grpo", "algo.lambda_alpha=2"], "algo.lambda_alpha", "only algo.advantage=gae reads it"),
    (["algo.name=grpo", "algo.critic_lambda=0.9"], "algo.critic_lambda", "algo.advantage=grpo trains no critic"),
    (["algo.name=grpo", "algo.policy_loss=dis", "algo.dual_clip_c=3"], "algo.dual_clip_c",
     "only algo.policy_loss=ppo and algo.policy_loss=decoupled_ppo read it"),
    (["algo.name=ppo", "algo.behavior_weight_cap=2"], "algo.behavior_weight_cap",
     "only algo.policy_loss=decoupled_ppo reads it"),
    (["algo.name=ppo", "algo.lambda_alpha=2"], "algo.lambda_alpha", "only the decoupled policy lambda reads it"),
    (["algo.policy_lambda=0.9"], "algo.policy_lambda", "only GAE with a fixed lambda reads it"),
    (["algo.name=grpo", "algo.kl_estimator=k1", "algo.kl_k3_clamp=5"], "algo.kl_k3_clamp", "only the k3 KL estimator"),
    (["algo.overlong_penalty=2"], "algo.overlong_penalty", "algo.overlong_buffer=0 turns the overlong penalty off"),
])
def test_unread_algorithm_keys_are_derived_from_the_chosen_parts(overrides, key, reason) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(f"{key}: set to ") and reason in str(e.value), str(e.value)


def test_the_chosen_parts_read_their_keys_and_an_import_path_may_read_any() -> None:
    assert load_config(None, ["algo.name=grpo", "algo.adv_eps=0.1"]).algo.adv_eps == 0.1
    assert load_config(None, ["algo.name=ppo", "algo.dual_clip_c=3"]).algo.dual_clip_c == 3
    assert load_config(None, ["algo.name=decoupled_ppo", "algo.dual_clip_c=3", "algo.behavior_weight_cap=2"])
    # A user's estimator or loss may read any algorithm option: none of its kind is rejected.
    user = ["algo.name=grpo", f"algo.advantage={__name__}:user_estimator", "algo.adv_eps=0.1",
            "algo.lambda_alpha=2", f"algo.policy_loss={__name__}:user_loss", "algo.dual_clip_c=3"]
    assert load_config(None, user).algo.lambda_alpha == 2
    with pytest.raises(ConfigError, match="algo.critic_lr: .*trains no critic"):  # it asks for no critic
        load_config(None, [*user, "algo.critic_lr=1e-3"])


def user_estimator(inp, cfg):  # named by import path above (never called: the config only loads)
    raise NotImplementedError


def user_loss(inp, cfg):
    raise NotImplementedError


def test_a_registered_estimator_reads_the_options_it_declares(monkeypatch) -> None:
    from tiderl.algos import registry
    from tiderl.algos.options import GRPOOptions

    monkeypatch.setitem(registry.ADVANTAGE_ESTIMATORS, "grpo_like",
                        registry.Estimator("tiderl.algos.advantages:grpo_token_advantages", GRPOOptions,
                                           needs_groups=True))
    with pytest.raises(ConfigError, match="only algo.advantage=grpo and algo.advantage=grpo_like read it"):
        load_config(None, ["algo.adv_eps=0.1"])
    assert load_config(None, ["algo.name=grpo", "algo.advantage=grpo_like", "algo.adv_eps=0.1"]).algo.adv_eps == 0.1


def test_every_registered_options_class_is_part_of_algo_config() -> None:
    from tiderl.algos import registry

    parts = set(AlgoConfig.__mro__)
    declared = [e.options for e in registry.ADVANTAGE_ESTIMATORS.values() if e.options]
    declared += [loss.options for loss in registry.POLICY_LOSSES.values()]
    assert all(options in parts for options in declared)
    assert dataclasses.fields(AlgoConfig)[0].name == "name"  # the preset first in every dump
