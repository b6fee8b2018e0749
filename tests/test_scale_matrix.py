"""The combinations a user at scale runs (issue 30), as `tiderl train --dry-run` judges them:
Ray backend x {torch engine, HTTP engine with two servers} x {no parallelism, DDP, FSDP2} x
{full weights, LoRA} x {staleness 0, 2}, plus drift on Ray: 25 in all. Each is either accepted
or refused with the reason below (docs/scale.md, "Supported combinations"; the README's table is
this test's result). When a refusal is lifted, move its row to ACCEPTED here and in the docs.
"""

from __future__ import annotations

import itertools

import pytest

from tiderl.cli import main

CONFIG = "configs/kg_sao_tiny.yaml"
TWO_SERVERS = "rollout.options.urls=[http://127.0.0.1:8001,http://127.0.0.1:8002]"


def combinations() -> list[tuple[str, list[str]]]:
    """(name, overrides) of the 25 combinations."""
    out = []
    for engine, parallel, weights, staleness in itertools.product(("torch", "http"), ("none", "ddp", "fsdp2"),
                                                                  ("full", "lora"), (0, 2)):
        overrides = ["system.backend=ray", f"system.max_staleness={staleness}"]
        if engine == "http":
            overrides += ["rollout.engine=http", TWO_SERVERS]
        if parallel != "none":
            overrides += [f"train.parallel={parallel}", "train.world_size=2"]
        if weights == "lora":
            overrides += ["model.lora.r=8", "model.critic_lora=lora"]
        out.append((f"{engine}-{parallel}-{weights}-staleness{staleness}", overrides))
    out.append(("torch-drift", ["system.backend=ray", "env.options.drift.every_steps=2"]))
    return out


def expected(name: str) -> tuple[str, str] | None:
    """None when `name` is accepted, else (field, reason) of its refusal. None is refused any more:
    the last six (LoRA with the HTTP engine) run since the engine merges the adapters into the
    weights its servers reload (tests/test_lora_http.py)."""
    return None


COMBINATIONS = combinations()


def test_the_matrix_has_the_25_combinations_of_issue_30():
    assert len(COMBINATIONS) == 25 and len({name for name, _ in COMBINATIONS}) == 25
    accepted = [name for name, _ in COMBINATIONS if expected(name) is None]
    # Before issue 30's slices: 8 (torch engine without LoRA on ranks, no drift on Ray); then every
    # torch-engine combination and drift (13); then the HTTP engine on Ray with full weights (its
    # servers synced by the driver's engine, 19); now LoRA with the HTTP engine too (merged weights).
    assert len(accepted) == 25, accepted


@pytest.mark.parametrize("name,overrides", COMBINATIONS, ids=[n for n, _ in COMBINATIONS])
def test_dry_run(name, overrides, capsys):
    code = main(["train", "--config", CONFIG, "--dry-run", *overrides])
    err = capsys.readouterr().err
    refusal = expected(name)
    if refusal is None:
        assert code == 0, err
    else:
        field, reason = refusal
        assert code == 2 and field in err and reason in err and "Fix:" in err, err


def test_lora_with_another_engine_is_refused_naming_the_two_that_take_it(capsys):
    """An engine other than torch and http has no LoRA path: the error names both that do."""
    code = main(["train", "--config", CONFIG, "--dry-run", "rollout.engine=tiderl.rollout.torch_engine:TorchEngine",
                 "model.lora.r=8"])
    err = capsys.readouterr().err
    assert code == 2 and "model.lora.r" in err and "rollout.engine=torch or http" in err and "Fix:" in err, err


@pytest.mark.slow
def test_the_http_engine_with_two_servers_and_fsdp2_ranks_trains_on_the_local_backend(cache, tmp_path):
    """The HTTP engine's rows on the local backend: `system.backend=local` with
    `rollout.engine=http` over two servers (vLLM stand-ins, `support.StubServer`) and 2 FSDP2
    ranks. The ranks run on a Ray the trainer starts (and stops); every step their weights reach
    the driver's engine and through it both servers (reloaded, probed, checksummed)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("httpx")
    import copy

    from support import SMALL_KG_RUN, StubServer
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.rollout.http_engine import HttpEngine
    from tiderl.rollout.weights import weights_checksum
    from tiderl.run import build_run

    common = SMALL_KG_RUN + ["algo.entropy_coef=0.01", f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"]
    assert not ray.is_initialized()
    first = build_run(load_config(CONFIG, common))  # builds (and caches) the model the servers start with
    servers = [StubServer(copy.deepcopy(first.actor.model), first.tokenizer) for _ in range(2)]
    try:
        run = build_run(load_config(CONFIG, common + [
            "rollout.engine=http", f"rollout.options.urls=[{servers[0].url},{servers[1].url}]",
            "train.steps=2", "train.parallel=fsdp2", "train.world_size=2", "system.max_staleness=1"]))
        assert isinstance(run.engine, HttpEngine)
        history, summary = train(run)
        assert [h["policy_version"] for h in history] == [1, 2]
        assert summary["ledger"]["trained"] == 8 and summary["ledger"]["failed"] == 0
        assert [s.reloads for s in servers] == [2, 2]  # one reload per step on each server
        assert all(s.requests for s in servers)  # requests went to both
        want = weights_checksum(run.actor.model.state_dict())
        assert run.engine.state_checksum() == want
        assert all(weights_checksum(s.engine.model.state_dict()) == want for s in servers)
        assert all(h["time/publish_s"] > 0 for h in history)  # the ranks gathered and published each step
        assert not ray.is_initialized()  # the Ray the trainer started is gone
    finally:
        for s in servers:
            s.close()
