"""The config tree: every shipped config parses; bad input names the field and the fix."""

from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import ConfigError, RunConfig, describe, dump_yaml, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_exist():
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # The resolved config round-trips through YAML.
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_yaml(cfg))
    assert load_config(dumped) == cfg


def test_defaults_are_the_papers():
    cfg = load_config(None, [])
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.3, 5.0)
    assert (cfg.algo.actor_lr, cfg.algo.critic_lr, cfg.algo.critic_updates) == (1e-6, 5e-6, 2)
    assert (cfg.algo.gamma, cfg.algo.critic_lambda, cfg.algo.lambda_alpha) == (1.0, 1.0, 1.5)


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["algo.critic_lr=5e-6", "data.hops=[1]", "log.tensorboard=false",
                             "train.steps=7"])
    assert cfg.algo.critic_lr == 5e-6 and isinstance(cfg.algo.critic_lr, float)
    assert cfg.data.hops == [1]
    assert cfg.log.tensorboard is False
    assert cfg.train.steps == 7


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.critic_rl=1e-3"])
    assert "algo.critic_rl" in str(e.value) and "Did you mean 'critic_lr'" in str(e.value)
    with pytest.raises(ConfigError, match="Did you mean 'rollout'"):
        load_config(None, ["rollot.batch_size=3"])


def test_wrong_type_names_field_and_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.eps_low=abc"])
    msg = str(e.value)
    assert "algo.eps_low" in msg and "Fix:" in msg and "0.3" in msg
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_config(None, ["train.steps=2.5"])


def test_range_and_choice_errors():
    with pytest.raises(ConfigError, match=r"rollout.top_p: .*Fix: use 1.0"):
        load_config(None, ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match="algo.advantage_values: 'later' is not one of"):
        load_config(None, ["algo.advantage_values=later"])
    with pytest.raises(ConfigError, match="env.max_total_tokens"):
        load_config(None, ["env.max_total_tokens=10"])


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  eps_low: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="has no '='"):
        load_config(None, ["algo.eps_low"])


def test_every_field_is_documented():
    rows = describe()
    assert len(rows) > 40
    undocumented = [key for key, help, _ in rows if not help]
    assert undocumented == []


def test_cli_dry_run_prints_resolved_config(capsys):
    sao = ROOT / "configs" / "sao.yaml"
    assert main(["train", "--config", str(sao), "--dry-run", "algo.critic_lr=7e-6"]) == 0
    out = capsys.readouterr().out
    assert "critic_lr: 7.0e-06" in out
    assert dump_yaml(load_config(sao, ["algo.critic_lr=7e-6"])) == out


@pytest.mark.parametrize("overrides, key, reason", [
    (["system.ray_workers=4"], "system.ray_workers", "only the Ray backend reads it"),
    (["system.partial_rollout=restart"], "system.partial_rollout", "max_staleness=0"),
    (["system.elastic_interval_s=5"], "system.elastic_interval_s", "rollout slots are fixed"),
    (["env.db_timeout_s=9"], "env.db_timeout_s", "only env.name=db reads it"),
    (["env.tool_latency_s=0.5"], "env.tool_latency_s", "env.tool_latency=none"),
    (["algo.name=grpo", "algo.value_clip=0.2"], "algo.value_clip", "trains no critic"),
])
def test_keys_that_nothing_reads_are_rejected(overrides, key, reason):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(key) and reason in str(e.value) and "Fix: remove" in str(e.value)
    # The same key at its default changes nothing and is accepted (resolved configs hold every key).
    assert load_config(None, [f"{key}={_default(key)}"]) is not None


def _default(key):
    value = load_config(None, [])
    for part in key.split("."):
        value = getattr(value, part)
    return value


def test_cli_reports_config_errors(capsys):
    assert main(["train", "algo.eps_hgh=3"]) == 2
    assert "Did you mean 'eps_high'" in capsys.readouterr().err


def test_every_key_is_read_by_something():
    """A key that no module outside config.py ever names is dead: each leaf's name must appear as
    an attribute or a string somewhere in the package (a coarse check: a name shared by two keys
    passes for both)."""
    import re

    source = "\n".join(p.read_text() for p in (ROOT / "tiderl").rglob("*.py") if p.name != "config.py")
    unread = [key for key, _, _ in describe()
              if not re.search(r"[.\"']" + re.escape(key.rsplit(".", 1)[-1]) + r"\b", source)]
    assert unread == []
