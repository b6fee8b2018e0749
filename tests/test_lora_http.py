"""A LoRA policy with the HTTP engine (issue 30; docs/engines.md, "LoRA with the HTTP engine"):
the trainer sends the adapters, the engine merges them into the weights its servers reload
(W + (alpha / r) B A) and probes each server against the UNMERGED policy, so a wrong merge fails
the sync instead of sampling from another policy.

- over a vLLM stand-in (`support.StubServer`): after an update the server holds exactly peft's
  own merge of the policy (`merge_and_unload`), the trainer's model is untouched, the checksum is
  the adapters'; a merge that omits the scale is caught by the probe; whole weights are refused;
- 2 training steps through `tiderl train`'s path with 2 launched tiderl servers: each reloaded
  twice, each serving the merged policy at the end (probe, and the written weights against
  peft's merge);
- the same on the Ray backend with 2 FSDP2 trainer ranks (they publish the adapters) and a Ray
  rollout worker.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
httpx = pytest.importorskip("httpx", reason="the HTTP engine needs httpx (pip install tiderl[http])")

from support import SMALL_KG_RUN, StubServer  # noqa: E402
from tiderl.config import load_config  # noqa: E402
from tiderl.rollout import lora as rollout_lora  # noqa: E402
from tiderl.rollout.http_engine import HttpEngine, ServerError  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.train.lora import apply_lora, merged_copy, policy_state  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj"]
CONFIG = "configs/kg_sao_tiny.yaml"
SMALL_RUN = SMALL_KG_RUN + ["train.steps=2", "rollout.engine=http", "rollout.options.launch=2", "model.lora.r=4",
                          "model.lora.alpha=16", "algo.actor_lr=0.01", "algo.entropy_coef=0.01"]


def _lora_policy(model, seed: int = 1):
    """`model` (copied) with adapters of scale 16 / 4 = 4 whose B is not zero: a trained policy."""
    policy = apply_lora(copy.deepcopy(model), r=4, alpha=16.0, target_modules=TARGETS)
    _train_adapters(policy, seed)
    return policy


def _train_adapters(policy, seed: int) -> None:
    """Stand-in for a training step: new random values in every B (and A) of `policy`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def _served(server: StubServer) -> dict[str, torch.Tensor]:
    return server.engine.model.state_dict()


def _assert_serves_merged(served: dict[str, torch.Tensor], policy) -> None:
    want = merged_copy(policy).state_dict()  # peft's merge, not ours
    assert set(served) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(served[name], tensor, atol=1e-6, rtol=1e-6, msg=name)


@pytest.fixture
def server(model, tokenizer):
    stub = StubServer(copy.deepcopy(model), tokenizer)
    yield stub
    stub.close()


def _engine(policy, tokenizer, server, tmp_path) -> HttpEngine:
    return HttpEngine(policy, tokenizer, urls=[server.url], weights_dir=tmp_path / "weights")


def test_an_update_sends_the_merged_policy_and_leaves_the_trainers_model_alone(model, tokenizer, server, tmp_path):
    policy = apply_lora(copy.deepcopy(model), r=4, alpha=16.0, target_modules=TARGETS)  # B = 0: the base
    engine = _engine(policy, tokenizer, server, tmp_path)  # the start-up probe passes on the base
    try:
        for version, seed in ((1, 1), (2, 2)):
            _train_adapters(policy, seed)
            before = {k: v.clone() for k, v in policy.state_dict().items()}
            sent = policy_state(policy)
            assert all(".lora_" in k for k in sent)  # only the adapters travel to the engine
            engine.update_weights(sent, version)
            assert server.reloads == version and engine.version == version
            _assert_serves_merged(_served(server), policy)
            assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())  # the trainer's, unchanged
            assert engine.state_checksum() == weights_checksum(sent)  # what the pool compares with the trainer's
            assert engine.last_sync["probe_max_abs_diff"] < 1e-4
        # The probe's reference is the unmerged policy (peft's forward): the server's greedy
        # log-probs equal the trainer's model's.
        prompt = engine.probe_prompt()
        (answer,) = engine.generate([prompt], rollout_params())
        ids = torch.tensor([prompt + answer.token_ids])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(answer.logprobs), want, atol=1e-4, rtol=0)
    finally:
        engine.close()


def rollout_params():
    from tiderl.rollout.base import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=6)


def test_a_merge_without_the_scale_fails_the_probe(model, tokenizer, server, tmp_path, monkeypatch):
    policy = apply_lora(copy.deepcopy(model), r=4, alpha=16.0, target_modules=TARGETS)
    engine = _engine(policy, tokenizer, server, tmp_path)
    try:
        _train_adapters(policy, 1)
        monkeypatch.setattr(rollout_lora, "merge_weight", lambda w, a, b, scaling: (w + b @ a).to(w.dtype))
        with pytest.raises(ServerError, match="differ from the trainer's weights"):
            engine.update_weights(policy_state(policy), 1)
        assert engine.state_checksum() != engine.state_checksum()  # NaN: no verified weights
        monkeypatch.undo()
        engine.update_weights(policy_state(policy), 1)  # the right merge passes
        _assert_serves_merged(_served(server), policy)
    finally:
        engine.close()


def test_whole_weights_are_refused_with_the_fix(model, tokenizer, server, tmp_path):
    policy = _lora_policy(model)
    engine = _engine(apply_lora(copy.deepcopy(model), r=4, alpha=16.0, target_modules=TARGETS), tokenizer, server,
                     tmp_path)
    try:
        with pytest.raises(ValueError, match="LoRA adapters.*policy_state"):
            engine.update_weights(merged_copy(policy).state_dict(), 1)
        assert server.reloads == 0 and engine.version == 0
    finally:
        engine.close()


def _check_servers_hold_the_merged_policy(engine: HttpEngine, policy) -> None:
    from safetensors.torch import load_file

    for url in engine.urls:
        engine._check_probe(url, what="after the run")  # against the unmerged policy
        assert httpx.get(url + "/health").json()["version"] == 2  # one reload per step
    _assert_serves_merged(load_file(str(Path(engine._folder) / "model.safetensors")), policy)
    assert engine.state_checksum() == weights_checksum(policy_state(policy))


@pytest.mark.slow
def test_two_lora_steps_with_two_launched_servers(cache, tmp_path):
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config(CONFIG, SMALL_RUN + [f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"]))
    engine = run.engine
    try:
        assert isinstance(engine, HttpEngine) and engine.launcher is not None
        history, summary = train(run)
        assert [h["policy_version"] for h in history] == [1, 2]
        assert summary["ledger"]["trained"] == 8 and summary["ledger"]["failed"] == 0
        trained = [k for k, v in policy_state(run.actor.model).items() if ".lora_B." in k and v.abs().sum() > 0]
        assert trained, "the adapters did not train: the test would not tell a merge from the base"
        _check_servers_hold_the_merged_policy(engine, run.actor.model)
    finally:
        engine.close()


@pytest.mark.slow
def test_lora_with_launched_servers_on_the_ray_backend_with_fsdp2_ranks(ray_cluster, cache, tmp_path):
    """Ray + FSDP2 + LoRA + the HTTP engine (a row of tests/test_scale_matrix.py that this work
    opened): the ranks publish the adapters, the driver's engine merges them and reloads each
    server once per version, a Ray worker sends the requests (one, not two: the test stays near
    40 s on the shared 2-core machine; tests/test_http_launch.py covers two workers)."""
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config(CONFIG, SMALL_RUN + [
        f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}", "system.backend=ray", "system.options.workers=1",
        "system.max_staleness=1", "model.critic_lora=lora", "train.parallel=fsdp2", "train.world_size=2"]))
    engine = run.engine
    try:
        history, summary = train(run)
        assert [h["policy_version"] for h in history] == [1, 2]
        assert summary["ledger"]["trained"] == 8 and summary["ledger"]["failed"] == 0
        assert sum(s["episodes"] for s in summary["backend"]["worker_stats"]) >= 8  # in the workers
        _check_servers_hold_the_merged_policy(engine, run.actor.model)
    finally:
        engine.close()
