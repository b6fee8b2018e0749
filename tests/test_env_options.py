"""A user's environment declares its own options, data sources and warm start, as a built-in
does (tiderl/envs/registration.py): the options are validated by its dataclass, listed by
`tiderl config`, read by its setup, and the embedded tiny model is built from its warm start.
An environment without a warm start gets a clean error, not a traceback, when it asks for the
tiny model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

import user_env  # tests/user_env.py: the parity environment this one extends
from tiderl.cli import main
from tiderl.config import ConfigError, load_config
from tiderl.envs.check import assert_environment
from tiderl.envs.protocol import Task
from tiderl.envs.registration import WarmStart
from tiderl.envs.setup import Setup, load_setup
from tiderl.options import need, opt

NAME = "test_env_options:CountingParityEnv"


@dataclass
class ParityOptions:
    """The options of the parity environment below (`env.options.*`)."""

    count: int = opt(30, "Numbers asked about, training and held out together.")
    held_out: float = opt(0.25, "Fraction of the numbers held out for evaluation.")
    wording: str = opt("question", "How a task is asked: 'question' or 'command'.", ("question", "command"))

    def check(self, cfg) -> None:
        need(self.count >= 4, "count", f"{self.count} leaves nothing to hold out", "use 30")
        need(0 < self.held_out < 1, "held_out", "must be in (0, 1)", "use 0.25")


def answer_turn(word: str) -> str:
    return '<tool_call>\n{"name": "answer", "arguments": {"word": "%s"}}\n</tool_call>' % word


def parity_demonstrations(setup, cfg, rng):
    """Warm-start scripts: the right answer to `model.warmstart.num_traces` drawn training tasks."""
    tasks = [rng.choice(setup.train_tasks) for _ in range(cfg.model.warmstart.num_traces)]
    return tasks, [[answer_turn(t.answer)] for t in tasks], {"demonstrated_numbers": len({t.task_id for t in tasks})}


class CountingParityEnv(user_env.ParityEnv):
    """The parity environment with options, two data sources and a warm start."""

    Options = ParityOptions
    sources = ("small", "large")  # numbers from 0, or from 1000; the first is the default
    warm_start = WarmStart(demonstrations=parity_demonstrations)

    @classmethod
    def setup(cls, cfg) -> Setup:
        options = cfg.env.options
        first = 0 if cfg.data.source == "small" else 1000
        ask = "Is {} even or odd?" if options.wording == "question" else "Say whether {} is even or odd."
        tasks = [Task(f"n{i}", ask.format(i), "even" if i % 2 == 0 else "odd") for i in range(first, first + options.count)]
        held = max(1, int(options.count * options.held_out))
        return Setup(train_tasks=tasks[held:], eval_tasks=tasks[:held], make_env=cls, name=cfg.data.source)


def test_the_options_are_read_by_the_setup():
    cfg = load_config(None, [f"env.name={NAME}", "env.options.count=12", "env.options.wording=command"])
    assert isinstance(cfg.env.options, ParityOptions) and cfg.data.source == "small"
    setup = load_setup(cfg)
    assert (len(setup.train_tasks), len(setup.eval_tasks)) == (9, 3)
    assert setup.eval_tasks[0].prompt == "Say whether 0 is even or odd."
    large = load_setup(load_config(None, [f"env.name={NAME}", "data.source=large"]))
    assert large.eval_tasks[0].task_id == "n1000" and len(large.train_tasks) + len(large.eval_tasks) == 30


@pytest.mark.parametrize("overrides, message", [
    (["env.options.cuont=3"], "unknown config key 'env.options.cuont'. Did you mean 'count'?"),
    (["env.options.count=many"], "env.options.count: expected an integer, got 'many'. Fix: set env.options.count "
                                 "like its default, 30."),
    (["env.options.wording=shout"], "env.options.wording: 'shout' is not one of 'question', 'command'."),
    (["env.options.count=2"], "env.options.count: 2 leaves nothing to hold out. Fix: use 30."),
    (["env.options.held_out=1.5"], "env.options.held_out: must be in (0, 1). Fix: use 0.25."),
    (["data.source=tiny"], f"data.source: env.name={NAME} reads small, large, not 'tiny'"),
    # A built-in environment's option is not this environment's.
    (["env.options.timeout_s=3"], f"env.options.timeout_s: env.name={NAME} has no such option; only env.name=db "
                                  "reads it"),
])
def test_the_options_are_validated_by_their_dataclass(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"env.name={NAME}", *overrides])
    assert message in str(e.value)


def test_an_environment_without_options_rejects_them():
    cfg = load_config(None, ["env.name=user_env:ParityEnv", "data.source=anything"])  # no sources: any
    assert cfg.data.source == "anything"
    with pytest.raises(ConfigError, match="env.options.count: env.name=user_env:ParityEnv declares no options"):
        load_config(None, ["env.name=user_env:ParityEnv", "env.options.count=3"])


def test_tiderl_config_lists_the_options(capsys):
    assert main(["config", f"env.name={NAME}"]) == 0
    out = capsys.readouterr().out
    assert f"env.options.count = 30\n    [env.name={NAME}] Numbers asked about" in out
    assert "env.options.timeout_s = 2.0\n    [env.name=db]" in out  # the built-ins' stay listed
    assert main(["config"]) == 0
    assert NAME not in capsys.readouterr().out  # without the choice, only the built-ins
    assert main(["config", "env.options.count=3"]) == 2  # env.name=kg has no such option
    assert "env.options.count" in capsys.readouterr().err


def test_the_environment_passes_the_contract_with_its_options():
    report = assert_environment(NAME, "env.options.count=20", "data.source=large", episodes=2)
    assert report.ok


@pytest.mark.slow  # a (two-step) warm start
def test_the_embedded_model_is_built_from_the_environments_warm_start(tmp_path):
    from tiderl.embedded.build import build_key, ensure_embedded_model

    small = [f"env.name={NAME}", f"model.cache_dir={tmp_path}", "model.tiny.vocab_size=300",
             "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
             "model.tiny.num_kv_heads=1", "model.warmstart.num_traces=24", "model.warmstart.steps=2",
             "model.warmstart.batch_size=4", "env.max_turns=2", "env.max_total_tokens=256",
             "rollout.max_new_tokens=64", "train.micro_batch_tokens=2048"]
    cfg = load_config(None, small)
    path = ensure_embedded_model(cfg, load_setup(cfg), log=lambda _: None)
    report = json.loads((path / "tiderl_build.json").read_text())
    assert path.name.startswith("test_env_options-CountingParityEnv-tiny-small-")
    assert report["demonstrations"] == 24 and report["demonstration_success"] == 1.0
    assert 0 < report["demonstrated_numbers"] <= 22  # the warm start's own report entry
    assert ensure_embedded_model(cfg, load_setup(cfg), log=lambda _: None) == path  # cached
    # The environment's options are part of the model's key.
    assert build_key(load_config(None, [*small, "env.options.count=40"])) != build_key(cfg)


def test_an_environment_without_a_warm_start_asks_for_a_model(tmp_path, capsys):
    """`tiderl train` with the embedded tiny model on a user's environment that has no warm start:
    a clean error naming the fix (it used to end in a KeyError traceback)."""
    code = main(["train", "--config", "configs/sao.yaml", "env.name=user_env:ParityEnv", "train.steps=2",
                 f"run_dir={tmp_path / 'run'}", f"model.cache_dir={tmp_path / 'cache'}", "log.progress=false"])
    err = capsys.readouterr().err
    assert code == 2
    assert "env.name=user_env:ParityEnv has no embedded tiny model" in err and "Fix: set model.path=DIR" in err
    assert "Traceback" not in err
