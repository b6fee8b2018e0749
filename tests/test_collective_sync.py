"""`rollout.options.weight_sync=collective` (issue 30: weights from the trainer's process straight
to the servers, no files): the HTTP engine opens a gloo group with each server (`tiderl.collective`)
and broadcasts the weights; the server loads them in place and the probe verifies them. Checked on
tiderl's engine server, which answers the same `/collective_rpc` methods as vLLM's worker
extension (tests/test_http_engine.py's `test_weights_reach_vllm_over_a_gloo_group` drives that
one where `make vllm` has run):

- an update reaches the server without a weight file, the server samples from the new weights,
  and a server that loaded other weights than the policy's fails the probe;
- a LoRA policy: the merged weights go over the group, the probe checks them unmerged;
- launched servers: one killed after an update comes back in a new group at the current weights;
- two steps through `tiderl train`.
"""

from __future__ import annotations

import copy

import pytest
import torch

httpx = pytest.importorskip("httpx", reason="the HTTP engine needs httpx (pip install tiderl[http])")

from support import greedy_reference, peaky_model, two_steps_on_launched_servers, wait_for_event  # noqa: E402
from tiderl.rollout.base import SamplingParams  # noqa: E402
from tiderl.rollout.http_engine import HttpEngine, ServerError  # noqa: E402
from tiderl.rollout.torch_engine import TorchEngine  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.serve.engine_api import EngineServer  # noqa: E402


@pytest.fixture
def server(model, tokenizer):
    engine_server = EngineServer(TorchEngine(copy.deepcopy(model), tokenizer, seed=0)).start()
    yield engine_server
    engine_server.close()


def test_an_update_goes_over_the_group_and_the_probe_checks_it(model, tokenizer, server, tmp_path):
    engine = HttpEngine(model, tokenizer, urls=[server.url], weights_dir=tmp_path / "w", weight_sync="collective")
    try:
        new = peaky_model(len(tokenizer), seed=1)
        engine.update_weights(new.state_dict(), 1)
        assert server.engine.version == 1 and server.reloads == 1
        assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir()), "no weight files"
        assert engine.last_sync["probe_max_abs_diff"] < 1e-5
        assert engine.state_checksum() == weights_checksum(new.state_dict())
        prompt = engine.probe_prompt()
        (completion,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))
        assert completion.token_ids == greedy_reference(new, prompt, 6)
        served = server.engine.model.state_dict()
        for name, tensor in new.state_dict().items():
            torch.testing.assert_close(served[name], tensor, rtol=0, atol=0, msg=name)
        # A server that loads other weights than the policy's fails the sync.
        other = peaky_model(len(tokenizer), seed=3).state_dict()
        engine.served_state = lambda: other
        with pytest.raises(ServerError, match="differ from the trainer's weights"):
            engine.update_weights(peaky_model(len(tokenizer), seed=2).state_dict(), 2)
    finally:
        engine.close()


def test_a_lora_policy_broadcasts_its_merge(model, tokenizer, server, tmp_path):
    pytest.importorskip("peft")
    from tiderl.train.lora import apply_lora, policy_state

    policy = apply_lora(copy.deepcopy(model), r=4, alpha=16.0, target_modules=["q_proj", "v_proj", "up_proj"])
    engine = HttpEngine(policy, tokenizer, urls=[server.url], weights_dir=tmp_path / "w", weight_sync="collective")
    try:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if ".lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        engine.update_weights(policy_state(policy), 1)
        assert engine.last_probe_diff < 1e-4 and engine.state_checksum() == weights_checksum(policy_state(policy))
        prompt = engine.probe_prompt()
        (completion,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))
        assert completion.token_ids == greedy_reference(policy, prompt, 6)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_killed_launched_server_joins_a_new_group_at_the_current_weights(model, tokenizer, tmp_path):
    engine = HttpEngine(model, tokenizer, urls=[], launch=2, weights_dir=tmp_path / "w", weight_sync="collective")
    try:
        new = peaky_model(len(tokenizer), seed=1)
        engine.update_weights(new.state_dict(), 1)
        engine.launcher.kill(0)
        back = wait_for_event(engine, "restarted", timeout_s=120)
        assert back["event"] == "restarted" and back["version"] == 1 and back["probe_max_abs_diff"] < 1e-5, back
        engine.update_weights(peaky_model(len(tokenizer), seed=2).state_dict(), 2)  # both take the next one
        for url in engine.urls:  # the restarted one: the catch-up in its new group, then version 2
            assert httpx.get(url + "/health").json()["version"] == 2
            engine._check_probe(url, what="after the restart and an update")
    finally:
        engine.close()


@pytest.mark.slow
def test_two_steps_through_tiderl_train(cache, tmp_path):
    with two_steps_on_launched_servers(cache, tmp_path, ["rollout.options.weight_sync=collective"], loads=2):
        assert not list((tmp_path / "run" / "engine_weights").glob("v*")), "no weight files"
