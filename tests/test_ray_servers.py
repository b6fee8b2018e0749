"""Launched inference servers as Ray actors (`rollout.options.launch_on=ray`, issue 30): each
server's process runs inside an actor that holds the server's declared resources, on the node the
cluster places it, and is reached at that node's address. The same launcher as for local servers
(`tiderl.rollout.launch`), so health checks, failover and restarts are the ones
tests/test_http_launch.py covers; here, on a 2-CPU local cluster:

- two servers hold their resources while they run and give them back when stopped; a server
  killed after an update is restarted by its actor, on its port, at the current weights;
- two training steps through `tiderl train` on the Ray backend with the servers as actors and
  the collective weight sync;
- `launch_on=ray` without the Ray backend is refused with the fix.
"""

from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx", reason="the HTTP engine needs httpx (pip install tiderl[http])")
ray = pytest.importorskip("ray")

from support import peaky_model, two_steps_on_launched_servers, wait_for_event  # noqa: E402
from tiderl.collective import address_towards  # noqa: E402
from tiderl.config import ConfigError, load_config  # noqa: E402
from tiderl.rollout.http_engine import HttpEngine  # noqa: E402

CONFIG = "configs/kg_sao_tiny.yaml"


@pytest.mark.slow
def test_servers_in_ray_actors_hold_their_resources_and_come_back(ray_cluster, model, tokenizer, tmp_path):
    free = ray.available_resources().get("CPU", 0)
    engine = HttpEngine(model, tokenizer, urls=[], launch=2, launch_on="ray", server_resources={"CPU": 0.5},
                        weights_dir=tmp_path / "w")
    try:
        assert engine.launcher.servers[0].process is None  # not a process of this one
        assert all(u.startswith(f"http://{ray.util.get_node_ip_address()}:") for u in engine.urls)  # the node's address
        assert ray.available_resources().get("CPU", 0) == pytest.approx(free - 1.0)
        engine.update_weights(peaky_model(len(tokenizer), seed=1).state_dict(), 1)
        url = engine.urls[0]
        engine.launcher.kill(0)
        back = wait_for_event(engine, "restarted", timeout_s=120)
        assert back["event"] == "restarted" and back["version"] == 1, engine.events
        assert engine.urls[0] == url and httpx.get(url + "/health").json()["version"] == 1
        engine._check_probe(url, what="after its restart")
    finally:
        engine.close()
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == pytest.approx(free)  # the actors are gone
    assert not engine.launcher.servers[0].alive() and not engine.launcher.servers[1].alive()


@pytest.mark.slow
def test_two_steps_on_the_ray_backend_with_the_servers_as_actors(ray_cluster, cache, tmp_path):
    """With the collective weight sync: the gloo groups reach the servers at their node's address."""
    overrides = ["rollout.options.launch_on=ray", "rollout.options.server_resources={CPU: 0.25}",
                 "rollout.options.weight_sync=collective", "system.backend=ray", "system.options.workers=1",
                 "system.max_staleness=1"]
    with two_steps_on_launched_servers(cache, tmp_path, overrides, loads=2) as (run, _):
        assert all(s.process is None for s in run.engine.launcher.servers)  # in the actors
        assert {s.host for s in run.engine._senders.values()} == {address_towards(run.engine.urls[0])}


def test_launch_on_ray_needs_the_ray_backend():
    with pytest.raises(ConfigError, match="rollout.options.launch_on.*set system.backend=ray"):
        load_config(CONFIG, ["rollout.engine=http", "rollout.options.launch=2", "rollout.options.launch_on=ray"])
