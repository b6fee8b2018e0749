"""Rewards from models off the event loop and in batches (tiderl/rewards/scoring.py), and the
judge's API key (reward.judge.api_key_env, sent as a bearer token, checked here by a local stub
server). The scorers are stubs that block the way a reward model's forward pass does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from support import QuietHTTPServer
from tiderl.config import ConfigError, dump_yaml, load_config
from tiderl.rewards.judge import PART as JUDGE, Judge, JudgeOptions
from tiderl.rewards.model import ModelRewards
from tiderl.rewards.scoring import BatchScorer, ScoredBackend
from tiderl.types import Trajectory


class Decoder:
    """A policy tokenizer for ModelRewards: the tokens as text (one user message)."""

    def decode(self, tokens, skip_special_tokens=False):
        return " ".join(map(str, tokens))


class SlowScorer:
    """Blocks its thread `seconds` per batch (as a reward model's forward pass does) and scores a
    conversation by its length; a batch with a task named bad... fails."""

    def __init__(self, seconds: float):
        self.seconds, self.batches, self.threads = seconds, [], set()

    def scores(self, conversations, task_ids=()):
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(task_ids))
        time.sleep(self.seconds)
        if any(i.startswith("bad") for i in task_ids):
            raise RuntimeError(f"stub scorer failed on task(s) {', '.join(task_ids)}")
        return [float(len(c[0]["content"].split())) for c in conversations]


class Backend:
    """A rollout backend whose episodes end at once: task "tN" (or "badN") gives N tokens, reward 1."""

    version = 7

    def __init__(self):
        self.closed = False

    async def run_episode(self, task, group_id):
        await asyncio.sleep(0)
        n = int(task[-1])
        return Trajectory(tokens=list(range(10, 10 + n)), loss_mask=[1] * n, behavior_logprobs=[0.0] * n,
                          policy_version=[0] * n, reward=1.0, reward_parts={"outcome": 1.0}, task_id=task)

    def report(self):
        return {"backend": "stub"}

    async def close(self):
        self.closed = True


def scored_backend(scorer, batch_size=4, wait_s=0.05, timeout_s=30.0):
    rewards = ModelRewards({JUDGE: (0.5, scorer)}, 2.0, Decoder())
    return ScoredBackend(Backend(), BatchScorer(rewards, batch_size, wait_s, timeout_s))


async def with_ticker(work):
    """(work's result, how many 10 ms ticks another coroutine made while it ran)."""
    ticks = 0
    done = asyncio.Event()

    async def tick():
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        return await work, ticks
    finally:
        done.set()
        await ticker


def test_episodes_are_scored_in_batches_while_the_event_loop_runs_on():
    scorer = SlowScorer(0.6)
    backend = scored_backend(scorer, batch_size=4)

    async def main():
        episodes = asyncio.gather(*(backend.run_episode(f"t{n}", "g") for n in (1, 2, 3, 4, 5, 6)))
        return await with_ticker(episodes)

    (results, ticks) = asyncio.run(main())
    # Two batches: the first 4 when the fourth arrived, the last 2 after batch_wait_s; each blocked
    # its thread 0.6 s, and meanwhile the loop kept ticking (on the loop: no tick at all).
    assert backend.scorer.batch_sizes == [4, 2] and [len(b) for b in scorer.batches] == [4, 2]
    assert ticks >= 30, f"the event loop was blocked while scoring ({ticks} ticks in 1.2 s)"
    assert scorer.threads == {"tiderl-reward_0"}
    for n, t in zip((1, 2, 3, 4, 5, 6), results):
        assert t.reward == pytest.approx(2.0 * 1.0 + 0.5 * n) and t.reward_parts == {"outcome": 2.0, JUDGE: 0.5 * n}
        assert t.env_info[f"{JUDGE}/score"] == n and t.task_id == f"t{n}"
    # The rest is the wrapped backend's.
    assert backend.version == 7 and backend.report() == {"backend": "stub"}
    asyncio.run(backend.close())
    assert backend.backend.closed


def test_a_slow_batch_times_out_and_a_failing_one_names_its_tasks():
    async def episode(backend, task):
        return await backend.run_episode(task, "g")

    with pytest.raises(RuntimeError, match=r"scoring the reward of task\(s\) t3 took over reward.timeout_s=0.2 s. Fix:"):
        asyncio.run(episode(scored_backend(SlowScorer(1.0), batch_size=1, timeout_s=0.2), "t3"))
    with pytest.raises(RuntimeError, match=r"stub scorer failed on task\(s\) bad4"):
        asyncio.run(episode(scored_backend(SlowScorer(0.0), batch_size=1), "bad4"))


def test_the_config_sets_batch_wait_and_timeout():
    cfg = load_config("configs/kg_sao_tiny.yaml", ["reward.judge.url=http://127.0.0.1:9/v1", "reward.judge.batch_size=5",
                                                   "reward.batch_wait_s=0.2", "reward.timeout_s=9"])
    scorer = BatchScorer.from_config(cfg, ModelRewards({}, 1.0, Decoder()))
    assert (scorer.batch_size, scorer.wait_s, scorer.timeout_s) == (5, 0.2, 9.0)
    for bad in ("reward.batch_wait_s=-1", "reward.timeout_s=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config("configs/kg_sao_tiny.yaml", ["reward.judge.url=http://127.0.0.1:9/v1", bad])
    with pytest.raises(ConfigError, match="reward.timeout_s"):  # no scorer: nothing reads it
        load_config("configs/kg_sao_tiny.yaml", ["reward.timeout_s=5"])


# -- the judge's API key ----------------------------------------------------------------------------


class _KeyedJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible /chat/completions that answers 401 without 'Authorization: Bearer sekrit-42'."""

    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        _KeyedJudge.seen.append(self.headers.get("Authorization"))
        ok = self.headers.get("Authorization") == "Bearer sekrit-42"
        data = json.dumps({"choices": [{"message": {"content": "8"}}]} if ok else {"error": "bad key"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def keyed_url():
    server = QuietHTTPServer(("127.0.0.1", 0), _KeyedJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_the_judge_sends_the_key_from_the_named_variable_and_never_shows_it(keyed_url, monkeypatch):
    chat = [{"role": "user", "content": "hi"}]
    monkeypatch.setenv("TIDERL_TEST_JUDGE_KEY", "sekrit-42")
    cfg = load_config("configs/kg_sao_tiny.yaml", [f"reward.judge.url={keyed_url}",
                                                   "reward.judge.api_key_env=TIDERL_TEST_JUDGE_KEY"])
    judge = Judge(cfg.reward.judge)
    assert judge.scores([chat], ["t1"]) == [pytest.approx(0.8)] and _KeyedJudge.seen[-1] == "Bearer sekrit-42"
    assert "sekrit" not in repr(judge) and "sekrit" not in repr(cfg) and "sekrit" not in dump_yaml(cfg)
    # Without the key the server refuses: the error names the task, not the key.
    with pytest.raises(RuntimeError, match=r"judge at .* on task t2: .*401") as error:
        Judge(JudgeOptions(url=keyed_url)).scores([chat], ["t2"])
    assert _KeyedJudge.seen[-1] is None and "sekrit" not in str(error.value)
    # A variable that is not set is refused before any work, naming the option and the fix.
    monkeypatch.delenv("TIDERL_TEST_JUDGE_KEY")
    with pytest.raises(ConfigError, match=r"reward.judge.api_key_env: names \$TIDERL_TEST_JUDGE_KEY, which is not set.*"
                                          r"export TIDERL_TEST_JUDGE_KEY="):
        load_config("configs/kg_sao_tiny.yaml", [f"reward.judge.url={keyed_url}",
                                                 "reward.judge.api_key_env=TIDERL_TEST_JUDGE_KEY"])
