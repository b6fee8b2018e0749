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
    cfg = load_config(None, ["algo.critic_lr=5e-6", "env.options.hops=[1]", "log.tensorboard=false",
                             "train.steps=7"])
    assert cfg.algo.critic_lr == 5e-6 and isinstance(cfg.algo.critic_lr, float)
    assert cfg.env.options.hops == [1]
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
    (["system.options.workers=4"], "system.options.workers", "only system.backend=ray reads it"),
    (["system.partial_rollout=restart"], "system.partial_rollout", "max_staleness=0"),
    (["system.elastic_interval_s=5"], "system.elastic_interval_s", "rollout slots are fixed"),
    (["env.options.timeout_s=9"], "env.options.timeout_s", "only env.name=db reads it"),
    (["env.tool_latency_s=0.5"], "env.tool_latency_s", "env.tool_latency=none"),
    (["algo.name=grpo", "algo.value_clip=0.2"], "algo.value_clip", "trains no critic"),
])
def test_keys_that_nothing_reads_are_rejected(overrides, key, reason):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(key) and reason in str(e.value) and "Fix: remove" in str(e.value)
    if ".options." not in key:  # (a component option has no default when its component is not chosen)
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


# -- environment options (env.options) ------------------------------------------------------------


def test_environment_options_follow_env_name():
    from tiderl.envs.db.registration import DBOptions
    from tiderl.envs.kg.registration import KGOptions

    assert isinstance(load_config(None, []).env.options, KGOptions)
    cfg = load_config(None, ["env.name=db", "env.options.timeout_s=0.5"])
    assert isinstance(cfg.env.options, DBOptions) and cfg.env.options.timeout_s == 0.5
    assert cfg.data.source == "agentbench_db"  # the environment's first source is its default
    assert load_config(None, ["env.name=math"]).data.source == "arithmetic"
    # A section made in code gets its environment's defaults too.
    assert isinstance(RunConfig().env.options, KGOptions) and RunConfig().data.source == "embedded"


@pytest.mark.parametrize("overrides, message", [
    # A typo inside the options: did-you-mean, as for run-level keys.
    (["env.options.hopz=[1]"], "unknown config key 'env.options.hopz'. Did you mean 'hops'?"),
    # Another environment's option: ignored under this choice, so rejected with the reason.
    (["env.options.backend=duckdb"], "env.options.backend: env.name=kg has no such option; only env.name=db "
                                     "reads it, so it would be ignored. Fix: remove env.options.backend, or set "
                                     "env.name=db."),
    (["env.name=code", "env.options.task_dir=/x"], "only env.name=repo reads it"),
    # Types are checked against the options' own dataclass.
    (["env.options.hops=abc"], "env.options.hops[0]: expected an integer, got 'abc'"),
    (["env.name=math", "env.options.calculator=maybe"], "env.options.calculator: expected true or false"),
    # The options check themselves; their fields are named with the full path.
    (["env.name=db", "env.options.timeout_s=0"], "env.options.timeout_s: must be > 0. Fix: use 2.0."),
    (["env.options.hops=[4]"], "env.options.hops: [4] must be a non-empty list of 1, 2, 3"),
    (["env.options.drift.kind=facts"], "env.options.drift.kind: set to 'facts', but drift.every_steps=0 turns drift off"),
    (["data.source=agentbench_kg"], "env.options.sparql_endpoint: AgentBench KG questions need"),
    (["env.name=repo", "data.source=folder"], "env.options.task_dir: data.source=folder reads task folders from it"),
    (["env.name=repo", "env.options.task_dir=/x"], "env.options.task_dir: set to '/x', but only data.source=folder"),
    # An option's check may name a run-level key in full.
    (["env.options.drift.every_steps=5", "system.backend=agent", "system.options.agent=mypkg.agents:solve"],
     "env.options.drift.every_steps: a drifting world"),
    # A data source the environment does not register names the one that does.
    (["env.name=kg", "data.source=agentbench_db"], "data.source: env.name=kg reads embedded, metaqa, agentbench_kg, "
                                                   "not 'agentbench_db'. Fix: use one of those, or env.name=db"),
])
def test_environment_option_errors_name_the_field_and_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("old, new", [
    ("env.db_backend=duckdb", "env.options.backend"), ("env.db_timeout_s=3", "env.options.timeout_s"),
    ("data.db_path=x.sqlite", "env.options.db_path"), ("data.questions=q.jsonl", "env.options.questions"),
    ("data.hops=[1]", "env.options.hops"), ("data.num_films=40", "env.options.num_films"),
    ("data.num_people=40", "env.options.num_people"), ("data.eval_fraction=0.3", "env.options.eval_fraction"),
    ("data.num_train_tasks=10", "env.options.num_train_tasks"), ("env.max_listed=3", "env.options.max_listed"),
    ("env.sparql_endpoint=u", "env.options.sparql_endpoint"), ("env.drift.every_steps=2", "env.options.drift"),
    ("env.math_tools=true", "env.options.calculator"), ("env.math_format_penalty=0.1", "env.options.format_penalty"),
    ("env.math_verify_timeout_s=3", "env.options.verify_timeout_s"), ("env.sandbox_cpu_s=3", "env.options.sandbox_cpu_s"),
    ("data.task_dir=/x", "env.options.task_dir"),
])
def test_a_moved_key_names_its_new_place(old, new):
    with pytest.raises(ConfigError) as e:
        load_config(None, [old])
    message = str(e.value)
    old_key = ".".join(old.split("=")[0].split(".")[:2])  # env.drift.every_steps: the drift section moved
    assert message.startswith(old_key + ": moved to") and f"Fix: write {new}" in message


def test_every_environment_option_is_listed_with_its_environment(capsys):
    from tiderl.envs.registration import builtin
    from tiderl.registry import ENVIRONMENTS

    rows = {(key, help.split("]")[0] + "]") for key, help, _ in describe()}
    for name in ENVIRONMENTS:
        options = builtin(name).Options
        for field in (options.__dataclass_fields__ if options else ()):
            prefix = f"[env.name={name}]"
            assert any(key.startswith(f"env.options.{field}") and tag == prefix for key, tag in rows), (name, field)
    # Run-level keys are listed as before; no environment option is listed without its environment.
    keys = {key for key, _ in rows}
    assert {"env.max_turns", "data.source", "algo.critic_lr", "system.backend"} <= keys
    assert all(tag.startswith("[env.name=") for key, tag in rows if key.startswith("env.options."))
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "env.options.timeout_s = 2.0\n    [env.name=db] Statement timeout in seconds." in out


def test_environment_options_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["env.name=math", "data.source=place_value", "env.options.num_train_tasks=50"])
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_yaml(cfg))
    assert "options:" in dumped.read_text() and load_config(dumped) == cfg


def test_loading_a_config_imports_no_environment_code():
    """The registrations are all config loading needs: neither torch nor an environment's modules."""
    import subprocess
    import sys

    code = ("import sys; import tiderl.config as c; c.load_config(None, ['env.name=math']); "
            "c.describe(); print(sorted(m for m in sys.modules if m.startswith('tiderl.envs.') "
            "and not m.endswith('.registration') and m not in ('tiderl.envs.kg', 'tiderl.envs.db', "
            "'tiderl.envs.math', 'tiderl.envs.code', 'tiderl.envs.repo', 'tiderl.envs.visual')), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[] False"


# -- engine and backend options (rollout.options, system.options) ---------------------------------


def test_engine_and_backend_options_follow_their_choice():
    from tiderl.options import NoOptions
    from tiderl.rollout.options import HttpEngineOptions, TorchEngineOptions
    from tiderl.system.ray_options import RayOptions

    cfg = load_config(None, [])
    assert isinstance(cfg.rollout.options, TorchEngineOptions) and isinstance(cfg.system.options, NoOptions)
    cfg = load_config(None, ["system.options.workers=3", "system.backend=ray"])
    assert isinstance(cfg.system.options, RayOptions) and cfg.system.options.workers == 3
    cfg = load_config(None, ["rollout.engine=http", "rollout.options.timeout_s=5"])
    assert isinstance(cfg.rollout.options, HttpEngineOptions) and cfg.rollout.options.timeout_s == 5
    # A section made in code gets its component's defaults too.
    assert RunConfig().rollout.options.prefill_tokens == 4096 and isinstance(RunConfig().system.options, NoOptions)


@pytest.mark.parametrize("old, new", [
    ("rollout.http.urls=[http://a]", "rollout.options.urls"), ("rollout.http.timeout_s=3", "rollout.options.timeout_s"),
    ("rollout.prefill_tokens=0", "rollout.options.prefill_tokens"), ("system.ray_address=auto", "system.options.address"),
    ("system.ray_workers=2", "system.options.workers"), ("system.ray_remote_critic=true", "system.options.remote_critic"),
    ("system.min_workers=1", "system.options.min_workers"), ("system.max_workers=4", "system.options.max_workers"),
    ("system.slots_per_worker=2", "system.options.slots_per_worker"),
    ("system.worker_drain_s=3", "system.options.worker_drain_s"), ("system.agent=a:b", "system.options.agent"),
])
def test_a_former_engine_or_backend_key_names_its_new_place(old, new):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["system.backend=ray", old])
    assert str(e.value).startswith(old.split("=")[0] + ": moved to " + new) and f"Fix: write {new}" in str(e.value)


def test_the_agent_backend_needs_its_agent_function(monkeypatch):
    with pytest.raises(ConfigError, match=r"^system.options.agent: is empty, and system.backend=agent plays an agent "
                                          r"function. Fix: set system.options.agent=mypkg.agents:solve"):
        load_config(None, ["system.backend=agent"])
    with pytest.raises(ConfigError, match="system.options.agent: 'solve' is not a 'module:function' import path"):
        load_config(None, ["system.backend=agent", "system.options.agent=solve"])
    cfg = load_config(None, ["system.backend=agent", f"system.options.agent={__name__}:_agent"])
    pytest.importorskip("fastapi")  # the serve extra
    from tiderl.serve.agent import AgentRollout

    built = []
    monkeypatch.setattr(AgentRollout, "__init__", lambda self, run, agent: built.append(agent))
    AgentRollout.from_run(type("Run", (), {"cfg": cfg})(), [])
    assert built == [_agent]  # from_run plays what system.options.agent names


async def _agent(base_url, task):
    return 0.0


def test_every_engine_and_backend_option_is_listed_and_documented(capsys):
    rows = {key: help for key, help, _ in describe()}
    for key, tag in [("rollout.options.prefill_tokens", "[rollout.engine=torch]"),
                     ("rollout.options.urls", "[rollout.engine=http]"), ("system.options.workers", "[system.backend=ray]"),
                     ("system.options.worker_drain_s", "[system.backend=ray]"),
                     ("system.options.agent", "[system.backend=agent]")]:
        assert rows[key].startswith(tag + " ") and len(rows[key]) > len(tag) + 10, key
    assert main(["config"]) == 0
    assert "rollout.options.prefill_tokens = 4096\n    [rollout.engine=torch] Prefill budget" in capsys.readouterr().out


def test_dry_run_shows_the_resolved_component_options(capsys):
    assert main(["train", "--dry-run", "system.backend=ray", "system.options.workers=3"]) == 0
    out = capsys.readouterr().out
    assert "  options:\n    address: ''\n    workers: 3\n" in out and "    prefill_tokens: 4096\n" in out
