"""`tiderl serve`: the OpenAI-compatible server, driven by the official `openai` client.

A tiny randomly initialised model (built in a second, no warm start) serves plain chats,
streams, and recorded sessions whose token ids are checked against what the engine sampled; a
random model never writes a tool call, so the tool-calling conversation is played by a
`ScriptedEngine` replaying the KG environment's oracle turns behind the same server (the
model's text is scripted, everything else is real: rendering, parsing, the wire format, the
recording). The recorded trajectory of that conversation equals `play_episode`'s token for
token, a recorded session trains one step through the run's own trainer, and an external agent's
sessions train through the rollout pool (the `agent` backend) under a staleness bound, with
checkpoints, metrics and the ledger.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tiderl.agent.chat import CONTINUE_MESSAGE, chat_format
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.config import load_config
from tiderl.embedded.tiny import (
    IM_END_ID,
    init_tiny_model,
    tiny_qwen2_config,
    train_tokenizer,
)
from tiderl.embedded.tiny_vlm import oracle_texts
from tiderl.envs.protocol import Action, ToolCall
from tiderl.envs.setup import load_setup
from tiderl.models.loading import save_model_dir
from tiderl.recipe import train
from tiderl.rollout.base import Completion, SamplingParams
from tiderl.run import Trainer, build_run, sync_weights
from tiderl.serve.agent import AgentRollout, service_for_run
from tiderl.serve.server import BackgroundServer, ChatService, create_app
from tiderl.serve.session import SessionStore
from tiderl.serve.wire import RequestError, assistant_reply, read_request
from tiderl.train.batching import collate
from tiderl.train.forward import token_logprobs
from tiderl.types import NO_VERSION

SMALL = ["env.options.num_films=40", "env.options.num_people=40", "data.eval_size=8", "rollout.batch_size=2",
         "rollout.max_new_tokens=24", "env.max_total_tokens=512", "algo.critic_warmup_steps=0",
         "algo.actor_lr=1e-3", "algo.critic_lr=1e-3", "log.progress=false", "train.micro_batch_tokens=4096"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of the KG environment on a tiny random model whose tokenizer knows the oracle's turns."""
    root = tmp_path_factory.mktemp("serve")
    base = load_config("configs/kg_sao_tiny.yaml", SMALL + [f"run_dir={root / 'run'}"])
    setup = load_setup(base)
    tasks = setup.train_tasks[:30] + setup.eval_tasks
    tokenizer = train_tokenizer(oracle_texts(setup.make_env(), tasks, {t.task_id: setup.oracle(t) for t in tasks}) * 2,
                                vocab_size=600)
    model = init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2,
                                              num_kv_heads=1), seed=0)
    save_model_dir(model, tokenizer, root / "model")
    cfg = load_config("configs/kg_sao_tiny.yaml", SMALL + [f"run_dir={root / 'run'}", f"model.path={root / 'model'}"])
    return build_run(cfg, setup)


def start(service: ChatService) -> BackgroundServer:
    return BackgroundServer(create_app(service)).start()


@pytest.fixture(scope="module")
def server(run):
    """The run's own engine (the continuous torch engine) behind the server."""
    service = service_for_run(run)
    service.override_sampling = False  # plain serving: the request's sampling settings count
    srv = start(service)
    yield srv
    srv.stop()


def client_for(url: str) -> Any:
    return openai.OpenAI(base_url=url, api_key="tiderl", max_retries=0)


def open_session(srv: BackgroundServer, **body: Any) -> str:
    return post(srv.url + "/sessions", body)[1]["session_id"]


def post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    """POST JSON (or `raw` bytes); returns (status, decoded body), errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Recorder:
    """An engine wrapper that keeps every prompt it got and every completion it returned."""

    def __init__(self, engine: Any):
        self.engine, self.calls = engine, []

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = self.engine.generate(prompts, params)
        self.calls += [(list(p), c) for p, c in zip(prompts, out)]
        return out

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.engine.update_weights(state_dict, version)


MESSAGES = [{"role": "system", "content": "You answer questions."}, {"role": "user", "content": "who directed film_001?"}]


# --- (a) plain chat, (b) streaming ----------------------------------------------------------------


def test_models_and_a_plain_chat_completion(server):
    client = client_for(server.url + "/v1")
    assert [m.id for m in client.models.list().data] == ["tiderl-policy"]
    response = client.chat.completions.create(model="any-name", messages=MESSAGES, max_tokens=8, logprobs=True)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= response.usage.completion_tokens <= 8
    assert response.usage.prompt_tokens == len(chat_format(server_tokenizer(server), None).prompt_ids(MESSAGES))
    assert len(choice.logprobs.content) == response.usage.completion_tokens
    assert all(t.logprob <= 0 for t in choice.logprobs.content)


def server_tokenizer(srv: BackgroundServer) -> Any:
    return srv.server.config.app.state.service.tokenizer


def test_streaming_chunks_are_the_recorded_reply_and_end_with_done(server):
    sid = open_session(server)
    client = client_for(f"{server.url}/sessions/{sid}/v1")
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True, max_tokens=12,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(get(f"{server.url}/sessions/{sid}")[1]["requests"][0]["sampled_ids"])
    record = get(f"{server.url}/sessions/{sid}")[1]
    assert streamed == (record["requests"][0]["message"]["content"] or "")
    # The raw event stream ends with the [DONE] sentinel.
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 4}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


# --- (d) exact token ids, log-probs, mask, prefix reuse ---------------------------------------------


def test_session_records_exactly_what_the_engine_sampled(run):
    recorder = Recorder(run.engine)
    service = ChatService(recorder, run.tokenizer, "tiny", max_new_tokens=16, max_total_tokens=512)
    with BackgroundServer(create_app(service)) as srv:
        sid = open_session(srv, task_id="t1")
        client = client_for(f"{srv.url}/sessions/{sid}/v1")
        messages = list(MESSAGES)
        for follow_up in ["go on", "and then?", "thanks"]:
            reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
        record = get(f"{srv.url}/sessions/{sid}")[1]
    requests, [segment] = record["requests"], record["segments"]
    assert len(requests) == len(recorder.calls) == 3
    end = IM_END_ID
    for request, (prompt, completion) in zip(requests, recorder.calls):
        keep = completion.token_ids.index(end) + 1 if end in completion.token_ids else len(completion.token_ids)
        assert request["prompt_ids"] == prompt  # what the engine was given
        assert request["sampled_ids"] == completion.token_ids[:keep]  # what it sampled
        assert request["logprobs"] == completion.logprobs[:keep]
        assert request["policy_version"] == [0] * keep
    # Prefix reuse: each prompt continues the previous prompt and the very ids sampled for it.
    for before, after in itertools.pairwise(requests):
        sampled = before["sampled_ids"] + ([] if before["sampled_ids"][-1] == end else [end])
        assert after["prompt_ids"][: len(before["prompt_ids"]) + len(sampled)] == before["prompt_ids"] + sampled
        assert after["reused_prompt_tokens"] == len(before["prompt_ids"]) + len(sampled)
        assert after["segment"] == 0 and after["new_segment_reason"] == ""
    assert requests[0]["new_segment_reason"] == "first request"
    # The segment is the last prompt and its reply; loss_mask is 1 exactly on sampled ids.
    last = requests[-1]
    assert segment["tokens"][: len(last["prompt_ids"]) + len(last["sampled_ids"])] == last["prompt_ids"] + last["sampled_ids"]
    sampled_positions = [i for r in requests for i in range(len(r["prompt_ids"]),
                                                            len(r["prompt_ids"]) + len(r["sampled_ids"]))]
    assert [i for i, m in enumerate(segment["loss_mask"]) if m] == sampled_positions
    assert all(v == NO_VERSION and lp == 0.0 for v, lp, m in
               zip(segment["policy_version"], segment["behavior_logprobs"], segment["loss_mask"]) if not m)
    # The trainer's recomputed log-probs are the recorded behaviour log-probs (temperature 1).
    session = service.store.get(sid)
    session.reward = 0.0
    [trajectory] = session.trajectories()
    batch = collate([trajectory], run.tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = token_logprobs(run.actor.model.eval(), batch.input_ids, batch.attention_mask)
    mask = batch.action_mask > 0
    assert mask.sum().item() == sum(len(r["sampled_ids"]) for r in requests)
    assert (recomputed[mask] - batch.behavior_logprobs[mask]).abs().max().item() < 1e-4


class SplitEngine:
    """Emits each turn's text one byte-level character token at a time: a tokenization the
    tokenizer itself would never produce, as a real model may sample."""

    def __init__(self, tokenizer: Any, text: str, delay_s: float = 0.0):
        self.tokenizer, self.version, self.delay_s = tokenizer, 3, delay_s
        self.ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)] + [IM_END_ID]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        time.sleep(self.delay_s)
        return [Completion(list(self.ids), [-0.5] * len(self.ids), "", "stop", [self.version] * len(self.ids))
                for _ in prompts]

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.version = version


def test_a_later_request_reuses_the_sampled_ids_not_a_re_encoding(run):
    tok = run.tokenizer
    text = "Final Answer: #0"
    engine = SplitEngine(tok, text)
    assert engine.ids[:-1] != tok.encode(text, add_special_tokens=False)  # re-encoding would drift
    service = ChatService(engine, tok, "split", max_new_tokens=64, max_total_tokens=512)
    with BackgroundServer(create_app(service)) as srv:
        sid = open_session(srv)
        client = client_for(f"{srv.url}/sessions/{sid}/v1")
        first = client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message
        assert first.content == text
        history = [*MESSAGES, first.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
        client.chat.completions.create(model="m", messages=history)
        # An edited history (the first question changed) cannot reuse anything: a new segment.
        edited = [MESSAGES[0], {"role": "user", "content": "who wrote film_002?"}, *history[2:]]
        client.chat.completions.create(model="m", messages=edited)
        record = get(f"{srv.url}/sessions/{sid}")[1]
    first_prompt = record["requests"][0]["prompt_ids"]
    second_prompt = record["requests"][1]["prompt_ids"]
    assert second_prompt[: len(first_prompt) + len(engine.ids)] == first_prompt + engine.ids
    fmt = chat_format(tok, None)
    assert fmt.prompt_ids(history) != second_prompt  # what a re-rendering would have sent instead
    assert fmt.prompt_ids(history)[: len(first_prompt)] == first_prompt
    assert [r["segment"] for r in record["requests"]] == [0, 0, 1]
    assert record["segments"][1]["reason"].startswith("history edited: message 1")
    assert record["requests"][2]["prompt_ids"] == fmt.prompt_ids(edited)  # rendered afresh, as said
    versions = record["segments"][0]["policy_version"]
    assert {v for v, m in zip(versions, record["segments"][0]["loss_mask"]) if m} == {3}


# --- (c) tool calls ----------------------------------------------------------------------------------


def play_with_openai(client: Any, env: Any, task: Any, max_turns: int, stream_first: bool = False) -> float:
    """An external agent: plays the KG environment through the chat completions API the way
    `play_episode` does (tool results as tool messages, a nudge as a user message)."""
    messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": env.reset(task)}]
    tools = env.tool_schemas()
    for turn in range(max_turns):
        if stream_first and turn == 0:
            message = streamed_message(client.chat.completions.create(model="m", messages=messages, tools=tools,
                                                                      tool_choice="auto", stream=True))
        else:
            message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
            message = message.model_dump(exclude_none=True)
        messages.append(message)
        calls = [ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message.get("tool_calls", [])]
        result = env.step(Action(text=message.get("content") or "", tool_calls=calls))
        if result.done:
            return result.reward
        if calls:
            messages += [{"role": "tool", "tool_call_id": message["tool_calls"][min(i, len(calls) - 1)]["id"],
                          "content": o} for i, o in enumerate(result.observations)]
        else:
            messages.append({"role": "user", "content": "\n\n".join(result.observations) or CONTINUE_MESSAGE})
    return env.finish("max_turns").reward


def streamed_message(stream: Any) -> dict[str, Any]:
    """The assistant message a stream adds up to (content pieces, tool calls by index)."""
    content, calls = "", {}
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                assert choice.finish_reason == ("tool_calls" if calls else "stop")
    out: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def test_a_tool_calling_conversation_equals_the_built_in_episode(run):
    setup, tok, env_cfg = run.setup, run.tokenizer, run.cfg.env
    task = next(t for t in setup.train_tasks if len(setup.oracle(t)) >= 3)  # at least two tool turns
    script = setup.oracle(task)
    service = ChatService(ScriptedEngine(tok, {task.prompt: script}), tok, "oracle", max_new_tokens=10**6,
                          max_total_tokens=10**6)
    with BackgroundServer(create_app(service)) as srv:
        sid = open_session(srv, task_id=task.task_id)
        client = client_for(f"{srv.url}/sessions/{sid}/v1")
        reward = play_with_openai(client, setup.make_env(), task, max_turns=len(script), stream_first=True)
        status, summary = post(f"{srv.url}/sessions/{sid}/reward", {"reward": reward})
        record = get(f"{srv.url}/sessions/{sid}")[1]
    assert status == 200 and reward == 1.0 and summary["trajectories"] == 1
    replies = [r["message"] for r in record["requests"]]
    assert len(replies) == len(script)
    assert all(r["finish_reason"] == "tool_calls" and r["message"]["tool_calls"] for r in record["requests"][:-1])
    assert record["requests"][-1]["finish_reason"] == "stop" and "tool_calls" not in replies[-1]
    assert all(r["new_segment_reason"] == "" for r in record["requests"][1:]) and len(record["segments"]) == 1
    # The same turns played by tiderl's own episode runner give the same trajectory, token by token.
    [built_in] = play_episodes(ScriptedEngine(tok, {task.prompt: script}), tok, setup.make_env, [task],
                               SamplingParams(max_new_tokens=10**6), max_turns=len(script), max_total_tokens=10**6)
    [served] = service.store.get(sid).trajectories()
    assert served.tokens == built_in.tokens
    assert served.loss_mask == built_in.loss_mask
    assert served.behavior_logprobs == built_in.behavior_logprobs
    assert served.policy_version == built_in.policy_version
    assert (served.reward, served.num_turns, served.stop_reason) == (built_in.reward, built_in.num_turns, "answer")
    assert env_cfg.max_turns >= 1


def test_a_malformed_tool_call_comes_back_as_content(run):
    tok = run.tokenizer
    broken = '<tool_call>\n{"name": "get_relations", "arguments": {"variable": }\n</tool_call>'
    service = ChatService(ScriptedEngine(tok, {"film_001": [broken]}), tok, "oracle", max_new_tokens=10**6,
                          max_total_tokens=10**6)
    tools = run.make_env().tool_schemas()
    with BackgroundServer(create_app(service)) as srv:
        sid = open_session(srv)
        response = client_for(f"{srv.url}/sessions/{sid}/v1").chat.completions.create(
            model="m", messages=MESSAGES, tools=tools)
        record = get(f"{srv.url}/sessions/{sid}")[1]
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == broken
    assert record["requests"][0]["parse_errors"] and "invalid JSON" in record["requests"][0]["parse_errors"][0]


def test_replies_split_calls_from_content():
    call = '<tool_call>\n{"name": "count", "arguments": {"variable": "#0"}}\n</tool_call>'
    reply = assistant_reply("Let me count.\n" + call, "auto", parse_tools=True, cut=False)
    assert reply.content == "Let me count." and reply.finish_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == \
        [("count", {"variable": "#0"})]
    assert reply.recorded()["tool_calls"][0]["function"]["arguments"] == {"variable": "#0"}
    none = assistant_reply(call, "auto", parse_tools=False, cut=True)  # tool_choice "none": text as it is
    assert (none.content, none.tool_calls, none.finish_reason) == (call, [], "length")
    assert assistant_reply("Final Answer: #1 STOP x", "auto", True, False, stop=[" STOP"]).content == "Final Answer: #1"


# --- (e) reward, training ---------------------------------------------------------------------------


def test_reward_ends_the_session_and_its_trajectories_train_one_step(run, server):
    sid = open_session(server, task_id="kg-1")
    client = client_for(f"{server.url}/sessions/{sid}/v1")
    messages = list(MESSAGES)
    for _ in range(2):
        reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    status, summary = post(f"{server.url}/sessions/{sid}/reward",
                           {"reward": 1.0, "info": {"success": True, "stop_reason": "max_tokens"}})
    assert status == 200 and summary["reward"] == 1.0 and summary["requests"] == 2 and summary["trajectories"] == 1
    with pytest.raises(openai.ConflictError, match="has ended"):
        client.chat.completions.create(model="m", messages=messages)
    store = server.server.config.app.state.service.store
    session = store.get(sid)
    [trajectory] = session.trajectories()
    assert trajectory.reward == 1.0 and trajectory.env_info["success"] is True and trajectory.num_turns == 2
    assert trajectory.task_id == trajectory.group_id == "kg-1"
    assert trajectory.stop_reason == "max_tokens"
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    metrics = Trainer(run, []).train([trajectory])  # the recorded layout is the trainer's own
    assert any(not torch.equal(before[k], v) for k, v in run.actor.model.state_dict().items())
    assert metrics and all(math.isfinite(v) for v in metrics.values())
    sync_weights(run)  # the engine serves the weights the other tests' expectations recompute with


def test_an_external_agents_sessions_train_through_the_pool_with_checkpoints(run, tmp_path):
    """An agent written against the async openai client plays the run's tasks; its sessions train
    through the rollout pool at staleness 1, with checkpoints, metrics and a balanced ledger. Its
    attempt at one task raises once: the pool retries the task instead of training a made-up reward."""
    import dataclasses

    played: list[str] = []
    raised: list[str] = []

    async def agent(base_url: str, task: Any) -> float:
        if not raised:
            raised.append(task.task_id)
            raise ConnectionError("the agent's own tool server is down")
        client = openai.AsyncOpenAI(base_url=base_url, api_key="tiderl", max_retries=0)
        env = run.make_env()
        messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": env.reset(task)}]
        response = await client.chat.completions.create(model="m", messages=messages, tools=env.tool_schemas())
        played.append(task.task_id)
        text = response.choices[0].message.content or ""
        return env.step(Action(text=text)).reward if "Final Answer" in text else 0.0

    cfg = dataclasses.replace(run.cfg, run_dir=str(tmp_path / "agent"),
                              system=dataclasses.replace(run.cfg.system, max_staleness=1),
                              train=dataclasses.replace(run.cfg.train, steps=2, checkpoint_every=1))
    agent_run = build_run(cfg, run.setup)
    history, summary = train(agent_run, backend=AgentRollout(agent_run, agent))
    assert agent_run.step == 2 and agent_run.engine.version == 2 and len(history) == 2
    assert len(played) >= 4 and summary["backend"]["sessions"] >= len(played) + 1
    assert all(m["system/staleness_max"] <= 1 for m in history)
    ledger = summary["ledger"]
    assert ledger["trained"] == 4 and ledger["retried"] == 1 and ledger["failed"] == 0, ledger
    assert ledger["started"] == sum(v for k, v in ledger.items() if k != "started"), ledger
    run_dir = tmp_path / "agent"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    for step in (1, 2):
        assert (run_dir / "checkpoints" / f"step_{step}" / "tiderl_checkpoint.json").is_file()
    events = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    retried = [e for e in events if e["ev"] == "retried"]
    assert len(retried) == 1 and retried[0]["task"] == raised[0] and "tool server is down" in retried[0]["reason"]
    assert raised[0] in played  # the task was played again, not lost


def test_a_cancelled_agent_session_counts_its_sampled_tokens_as_waste(run):
    """The pool cancels an episode (new weights at staleness 0, shutdown): the agent backend counts
    the tokens its session had sampled (`cut_tokens`, the run's waste), as the other backends do."""
    answered = asyncio.Event()
    sampled: list[int] = []

    async def agent(base_url: str, task: Any) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="tiderl", max_retries=0)
        response = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task.prompt}])
        sampled.append(response.usage.completion_tokens)
        answered.set()
        await asyncio.Event().wait()  # still working when the pool cancels it
        return 0.0

    async def scenario() -> AgentRollout:
        rollout = AgentRollout(run, agent)
        await rollout.start()
        try:
            episode = asyncio.create_task(rollout.run_episode(run.setup.train_tasks[0], "g"))
            await asyncio.wait_for(answered.wait(), 60)
            episode.cancel()
            with pytest.raises(asyncio.CancelledError):
                await episode
        finally:
            await rollout.close()
        return rollout

    rollout = asyncio.run(scenario())
    assert sampled[0] > 0 and rollout.cut_tokens == sampled[0]


# --- bad requests -----------------------------------------------------------------------------------


def test_bad_requests_get_clear_4xx_errors(server):
    url = server.url
    chat = {"model": "m", "messages": MESSAGES}
    status, body = post(f"{url}/sessions/nope/v1/chat/completions", chat)
    assert status == 404 and "no session 'nope'" in body["error"]["message"]
    assert post(f"{url}/sessions/nope/reward", {"reward": 1})[0] == 404
    status, body = post(f"{url}/v1/chat/completions", None, raw=b'{"messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(f"{url}/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages[0].role" and "robot" in body["error"]["message"]
    status, body = post(f"{url}/v1/chat/completions", {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post(f"{url}/v1/chat/completions", {**chat, "messages": [*MESSAGES, {"role": "assistant",
                                                                                         "content": "x"}]})
    assert status == 400 and "last message" in body["error"]["message"]
    status, body = post(f"{url}/v1/chat/completions", {**chat, "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, body = post(f"{url}/v1/chat/completions", {**chat, "temperature": "hot"})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = post(f"{url}/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x " * 600}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    sid = open_session(server, session_id="fixed-id")
    assert post(f"{url}/sessions", {"session_id": "fixed-id"})[0] == 409
    status, body = post(f"{url}/sessions/{sid}/reward", {"reward": "great"})
    assert status == 400 and body["error"]["param"] == "reward"
    assert post(f"{url}/sessions/{sid}/reward", {"reward": 0.5})[0] == 200
    assert post(f"{url}/sessions/{sid}/reward", {"reward": 0.5})[0] == 409
    assert get(f"{url}/sessions/unknown")[0] == 404


class FailingEngine:
    version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        raise RuntimeError("the GPU caught fire")


def test_an_engine_failure_is_a_500_with_its_message(run):
    with BackgroundServer(create_app(ChatService(FailingEngine(), run.tokenizer, "x", 8, 512))) as srv:
        status, body = post(f"{srv.url}/v1/chat/completions", {"messages": MESSAGES})
    assert status == 500 and "the GPU caught fire" in body["error"]["message"]


def test_read_request_normalises_what_clients_send():
    request = read_request({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "count", "arguments": '{"variable": "#0"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}],
        "tools": [{"type": "function", "function": {"name": "count"}}], "stop": "END", "max_tokens": 5})
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    assert request.messages[2]["tool_calls"][0]["function"]["arguments"] == {"variable": "#0"}
    assert request.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert (request.stop, request.max_tokens, request.parse_tools) == (["END"], 5, True)
    with pytest.raises(RequestError, match="image|text part"):
        read_request({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    with pytest.raises(RequestError, match="not valid JSON"):
        read_request({"messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{"}}]}, {"role": "user", "content": "x"}]})


def test_session_store_refuses_bad_rewards_and_finished_sessions():
    finished = []
    store = SessionStore(on_finish=finished.append)
    session = store.create("s1", task_id="t")
    for bad in (float("nan"), True, None, "1"):
        with pytest.raises(RequestError):
            store.finish("s1", bad)
    assert not session.finished
    store.finish("s1", 2)
    with pytest.raises(RequestError) as err:
        store.get("s1", open_only=True)
    assert err.value.status == 409
    assert [s.session_id for s in finished] == ["s1"]  # on_finish: once, when the reward came
    assert session.trajectories() == []  # no request, no segment


def test_concurrent_requests_extending_one_conversation_fork_it(run):
    """Two requests of one session that extend the same conversation at once: the first to finish
    extends the segment, the other forks a new one (the engine takes 0.3 s a turn, so both are
    planned before either is answered)."""
    engine = SplitEngine(run.tokenizer, "ok", delay_s=0.3)
    service = ChatService(engine, run.tokenizer, "split", max_new_tokens=64, max_total_tokens=512)
    with BackgroundServer(create_app(service)) as srv:
        sid = open_session(srv)
        base = f"{srv.url}/sessions/{sid}/v1"
        first = client_for(base).chat.completions.create(model="m", messages=MESSAGES).choices[0].message
        history = [*MESSAGES, first.model_dump(exclude_none=True)]

        async def both() -> None:
            client = openai.AsyncOpenAI(base_url=base, api_key="tiderl", max_retries=0)
            await asyncio.gather(*(client.chat.completions.create(
                model="m", messages=[*history, {"role": "user", "content": q}]) for q in ("a?", "b?")))

        asyncio.run(both())
        record = get(f"{srv.url}/sessions/{sid}")[1]
    assert sorted(r["segment"] for r in record["requests"]) == [0, 0, 1]
    forked = record["segments"][1]
    assert forked["reason"].startswith("forked") and forked["tokens"][:len(record["requests"][0]["prompt_ids"])] == \
        record["requests"][0]["prompt_ids"]


# --- tiderl serve --------------------------------------------------------------------------------------


def test_the_serve_command_builds_its_service_from_the_config_and_records_sessions(run, tmp_path, capsys):
    from tiderl.cli import main
    from tiderl.serve.server import service_from_config
    from tiderl.train.value_pretrain import load_trajectories

    assert main(["serve", "--config", "configs/kg_sao_tiny.yaml", "--port", "8123", "--dry-run",
                 f"model.path={run.cfg.model.path}"]) == 0
    assert f"path: {run.cfg.model.path}" in capsys.readouterr().out
    record = tmp_path / "sessions.jsonl"
    service = service_from_config(run.cfg, record=str(record))
    assert (service.max_new_tokens, service.max_total_tokens) == (24, 512)
    with BackgroundServer(create_app(service)) as srv:
        assert [m.id for m in client_for(srv.url + "/v1").models.list().data] == ["model"]
        sid = open_session(srv, task_id="kg-7")
        client_for(f"{srv.url}/sessions/{sid}/v1").chat.completions.create(model="model", messages=MESSAGES)
        assert post(f"{srv.url}/sessions/{sid}/reward", {"reward": 0.25})[0] == 200
    [trajectory] = load_trajectories(record)
    assert trajectory.reward == 0.25 and trajectory.task_id == "kg-7" and trajectory.num_action_tokens >= 1
