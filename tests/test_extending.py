"""The one-file extension points: an environment, an advantage estimator and a policy loss that
live outside tiderl, named in the config, trained through `tiderl train` with no edit inside
tiderl (docs/extending.md walks through the same code)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import ConfigError, describe, load_config
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.envs.check import assert_environment, check_environment
from tiderl.models.loading import save_model_dir
from tiderl.options import need, opt
from tiderl.rollout.options import TorchEngineOptions

import user_env  # tests/user_env.py: on sys.path when pytest runs (rootdir-relative import)


@pytest.fixture(scope="module")
def parity_model(tmp_path_factory):
    """A tiny untrained model whose tokenizer knows the parity environment's texts."""
    tokenizer = train_tokenizer(user_env.corpus(), vocab_size=300)
    model = init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=1,
                                              num_heads=2, num_kv_heads=1, max_position_embeddings=512), seed=0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("parity") / "model")


def test_user_environment_passes_the_contract(capsys):
    report = assert_environment("user_env:ParityEnv")
    assert len(report.checks) >= 10
    assert main(["check-env", "user_env:ParityEnv"]) == 0  # the same from the command line
    assert "0 failed" in capsys.readouterr().out


def test_contract_check_reports_a_broken_environment():
    class Broken(user_env.ParityEnv):
        def step(self, action):
            raise RuntimeError("boom")  # bad model output must become an observation, not a crash

    user_env.Broken = Broken
    try:
        report = check_environment(load_config(None, ["env.name=user_env:Broken"]))
    finally:
        del user_env.Broken
    assert not report.ok
    assert any(name.startswith("step on") and not passed and "boom" in detail
               for name, passed, detail in report.checks), report.text()


def test_unknown_environment_is_a_config_error_naming_the_fix(capsys):
    assert main(["train", "env.name=no such env"]) == 2
    assert "env.name" in capsys.readouterr().err


def test_user_environment_and_engine_train_through_tiderl_train(parity_model, tmp_path):
    before, prompts_before = user_env.ParityEnv.steps_taken, user_env.CountingEngine.prompts
    code = main(["train", "env.name=user_env:ParityEnv", "data.source=parity", f"model.path={parity_model}",
                 "rollout.engine=user_env:CountingEngine",
                 f"run_dir={tmp_path}", "algo.name=grpo", "algo.group_size=4", "rollout.batch_size=8",
                 "train.steps=2", "env.max_turns=2", "env.max_total_tokens=200", "rollout.max_new_tokens=24",
                 "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false"])
    assert code == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["policy_version"] == s["step"] for s in steps)
    assert user_env.ParityEnv.steps_taken > before  # the episodes ran in the user's environment
    assert user_env.CountingEngine.prompts >= 16 + prompts_before  # ... on the user's engine
    assert (tmp_path / "checkpoints" / "final" / "actor" / "config.json").is_file()
    ledger = json.loads((tmp_path / "system.json").read_text())["ledger"]
    assert ledger["trained"] == 16 and ledger["failed"] == 0


def docs_code_block(heading: str) -> str:
    """The last ```python block of docs/extending.md's section `heading`."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n")[-1].split("```", 1)[0]


def test_a_user_backend_written_from_the_docs_trains_through_tiderl_train(parity_model, tmp_path, monkeypatch):
    """The backend of docs/extending.md, copied from the page as it is, trains through `tiderl train`
    at staleness 0 and 1: the recipe builds it with the documented call and the pool accounts for
    every attempt."""
    (tmp_path / "mybackend.py").write_text(docs_code_block("A rollout backend"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for staleness in (0, 1):
        run_dir = tmp_path / f"run{staleness}"
        code = main(["train", "env.name=user_env:ParityEnv", "data.source=parity", f"model.path={parity_model}",
                     "system.backend=mybackend:InProcessBackend", "system.options.decode_batch=4",
                     f"system.max_staleness={staleness}",
                     f"run_dir={run_dir}", "algo.name=grpo", "algo.group_size=4", "rollout.batch_size=8",
                     "train.steps=2", "env.max_turns=2", "env.max_total_tokens=200", "rollout.max_new_tokens=24",
                     "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false"])
        assert code == 0
        system = json.loads((run_dir / "system.json").read_text())
        assert system["backend"]["episodes"] >= 16  # the episodes ran on the user's backend
        assert system["backend"]["decode_batch"] == 4  # ... which read its own option
        ledger = system["ledger"]
        assert ledger["trained"] == 16 and ledger["failed"] == 0
        assert ledger["started"] == sum(v for k, v in ledger.items() if k != "started"), ledger
        assert (run_dir / "checkpoints" / "final" / "actor" / "config.json").is_file()


# -- a user's engine and backend declare options of their own ---------------------------------------


@dataclass
class TracingOptions(TorchEngineOptions):
    trace_every: int = opt(0, "Log every N-th prompt (0 = none).")

    def check(self, cfg):
        super().check(cfg)
        need(self.trace_every >= 0, "trace_every", "must be >= 0", "use 0 (none) or e.g. 100")


class TracingEngine(user_env.CountingEngine):
    """A user's engine whose options extend the torch engine's (read as cfg.rollout.options)."""

    Options = TracingOptions


def test_a_user_engine_declares_its_own_options(capsys):
    engine = f"rollout.engine={__name__}:TracingEngine"
    cfg = load_config(None, [engine, "rollout.options.trace_every=5", "rollout.options.prefill_tokens=64"])
    assert isinstance(cfg.rollout.options, TracingOptions)
    assert (cfg.rollout.options.trace_every, cfg.rollout.options.prefill_tokens) == (5, 64)
    assert cfg.rollout.options == load_config(None, [engine, "rollout.options.trace_every=5",
                                                     "rollout.options.prefill_tokens=64"]).rollout.options
    errors = {"rollout.options.trace_every=-1": "rollout.options.trace_every: must be >= 0. Fix: use 0",
              "rollout.options.prefill_tokens=-1": "rollout.options.prefill_tokens: must be >= 0",
              "rollout.options.trace_evry=1": "unknown config key 'rollout.options.trace_evry'. Did you mean "
                                              "'trace_every'?",
              "rollout.options.urls=[http://x]": "rollout.options.urls: rollout.engine=test_extending:TracingEngine "
                                                 "has no such option; only rollout.engine=http reads it"}
    for override, message in errors.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [engine, override])
        assert message in str(e.value)
    rows = {key: help for key, help, _ in describe(chosen=cfg)}
    assert rows["rollout.options.trace_every"] == f"[rollout.engine={__name__}:TracingEngine] Log every N-th prompt " \
                                                 "(0 = none)."
    assert main(["config", engine]) == 0
    assert "rollout.options.trace_every = 0" in capsys.readouterr().out


def test_a_user_backend_declares_its_own_options(tmp_path, monkeypatch, capsys):
    (tmp_path / "mybackend.py").write_text(docs_code_block("A rollout backend"))
    monkeypatch.syspath_prepend(str(tmp_path))
    backend = "system.backend=mybackend:InProcessBackend"
    assert load_config(None, [backend, "system.options.decode_batch=4"]).system.options.decode_batch == 4
    with pytest.raises(ConfigError, match=r"system.options.decode_batch: must be >= 0. Fix: use 0 or e.g. 8"):
        load_config(None, [backend, "system.options.decode_batch=-2"])
    with pytest.raises(ConfigError, match="system.options.workers: system.backend=mybackend:InProcessBackend has no "
                                          "such option; only system.backend=ray reads it"):
        load_config(None, [backend, "system.options.workers=2"])
    assert main(["config", backend]) == 0
    out = capsys.readouterr().out
    assert "system.options.decode_batch = 0\n    [system.backend=mybackend:InProcessBackend] Largest batch" in out
    # The built-in backends' options are listed with theirs.
    assert "system.options.workers = 1\n    [system.backend=ray]" in out
    assert "system.options.agent = ''\n    [system.backend=agent]" in out
