"""The agent loop and its token assembly, with the tiny tokenizer, a fake environment and two
engines: ScriptedEngine (text scripts) and FakeEngine (raw token ids with made-up log-probs)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from support import observation_ids, user_message_ids, versions
from tiderl.agent.chat import ChatFormat, TemplateError, chat_format
from tiderl.agent.loop import CONTINUE_MESSAGE, ScriptedEngine, play_episodes
from tiderl.embedded.tiny import IM_END_ID, train_tokenizer
from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.rollout.base import Completion, SamplingParams
from tiderl.types import NO_VERSION

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the value stored under a key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
TABLE = {"alien": "Ridley Scott", "heat": "Michael Mann", "up": "Pete Docter"}
SYSTEM = "Use lookup(key) to read the table, then reply ANSWER: <value>."


def call(key: str, name: str = "lookup") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": {"key": key}})}\n</tool_call>'


class FakeEnv:
    """Looks keys up in TABLE; ends when a turn says "ANSWER: <value>" (reward 1 if right).

    Malformed calls and unknown tools get an "error: ..." observation. A turn without a call
    or answer gets no observation. task.meta may ask it to fail in reset or step, or to pay a
    shaping reward per tool step.
    """

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.finished: list[str] = []
        self.task: Task | None = None

    def system_prompt(self) -> str:
        return SYSTEM

    def tool_schemas(self) -> list[dict[str, Any]]:
        return TOOLS

    def reset(self, task: Task) -> str:
        if task.meta.get("fail_reset"):
            raise RuntimeError("reset exploded")
        self.task = task
        return task.prompt

    def step(self, action: Action) -> StepResult:
        assert self.task is not None
        self.actions.append(action)
        if self.task.meta.get("fail_step") == len(self.actions):
            raise RuntimeError("step exploded")
        observations = [f"error: {e}" for e in action.parse_errors]
        for tool_call in action.tool_calls:
            if tool_call.name != "lookup":
                observations.append(f"error: unknown tool {tool_call.name!r}")
            else:
                observations.append(TABLE.get(tool_call.arguments.get("key", ""), "not found"))
        if observations:
            return StepResult(observations, reward=self.task.meta.get("shaping", 0.0))
        if "ANSWER:" in action.text:
            right = action.text.split("ANSWER:", 1)[1].strip() == self.task.answer
            reward = 1.0 if right else 0.0
            return StepResult([], reward=reward, done=True, info={"success": int(right), "reward_parts": {"outcome": reward}})
        return StepResult([])

    def finish(self, reason: str) -> StepResult:
        self.finished.append(reason)
        return StepResult([], reward=0.0, done=True, info={"success": 0})


class EnvFactory:
    """make_env that remembers every environment it made, in order."""

    def __init__(self) -> None:
        self.envs: list[FakeEnv] = []

    def __call__(self) -> FakeEnv:
        env = FakeEnv()
        self.envs.append(env)
        return env


class FakeEngine:
    """Returns `ids_for(call_index, prompt_index)` for each prompt, with log-probs
    -0.01 * (position + 1) and versions 7, 8, 7, 8, ...; records every call."""

    def __init__(self, ids_for, finish_reason: str = "stop", ignore_limit: bool = False):
        self.ids_for = ids_for
        self.finish_reason = finish_reason
        self.ignore_limit = ignore_limit
        self.version = 7
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        call_index = len(self.calls)
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for i in range(len(prompts)):
            ids = list(self.ids_for(call_index, i))
            if not self.ignore_limit:
                ids = ids[: params.max_new_tokens]
            out.append(
                Completion(
                    token_ids=ids,
                    logprobs=[-0.01 * (k + 1) for k in range(len(ids))],
                    text="",
                    finish_reason=self.finish_reason,
                    policy_version=[7 + k % 2 for k in range(len(ids))],
                )
            )
        return out

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.version = version


@pytest.fixture(scope="module")
def tok():
    corpus = [SYSTEM, CONTINUE_MESSAGE, "Who directed Alien? Who directed Heat? Who directed Up?"]
    corpus += [call(k) for k in TABLE] + [f"ANSWER: {v}" for v in TABLE.values()]
    corpus += ["error: unknown tool", "not found", "<tool_response>", "</tool_response>", "Let me think."]
    return train_tokenizer(corpus * 4, vocab_size=600)


def task(key: str, **meta: Any) -> Task:
    return Task(task_id=f"t-{key}", prompt=f"Who directed {key.title()}?", answer=TABLE.get(key, ""), meta=meta)


def render(tok, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=add_generation_prompt, tokenize=False)


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def sampled_turn(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [IM_END_ID]


PARAMS = SamplingParams(max_new_tokens=64)


# --- chat.py -----------------------------------------------------------------------------------


def test_assembled_tokens_equal_template_rendering_of_full_conversation(tok):
    a1 = "Let me think.\n" + call("alien") + call("heat")
    a2 = "hmm"
    a3 = "ANSWER: Ridley Scott"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Alien?"}]
    fmt = chat_format(tok, TOOLS)
    ids = fmt.prompt_ids(messages)
    ids += sampled_turn(tok, a1) + observation_ids(fmt, ["Ridley Scott", "Michael Mann"])
    ids += sampled_turn(tok, a2) + user_message_ids(fmt, CONTINUE_MESSAGE)
    ids += sampled_turn(tok, a3)
    messages += [
        {"role": "assistant", "content": a1},
        {"role": "tool", "content": "Ridley Scott"},
        {"role": "tool", "content": "Michael Mann"},
        {"role": "assistant", "content": a2},
        {"role": "user", "content": CONTINUE_MESSAGE},
        {"role": "assistant", "content": a3},
    ]
    text = render(tok, messages, add_generation_prompt=False)
    # The episode ends on the sampled end-of-turn token; whatever the template writes after the
    # last turn (a newline here) belongs to a next turn that never came.
    text = text[: text.rindex("<|im_end|>") + len("<|im_end|>")]
    assert decode(tok, ids) == text
    # Special tokens split the text, so piecewise encoding is also the one-shot encoding.
    assert ids == tok.encode(text, add_special_tokens=False)


def test_observation_ids_end_with_generation_prompt_and_start_after_end_of_turn(tok):
    obs = decode(tok, observation_ids(chat_format(tok, TOOLS), ["Pete Docter"]))
    assert obs.endswith("<|im_start|>assistant\n")
    assert "Pete Docter" in obs and "<|im_end|>" not in obs.split("Pete Docter")[0]


def test_chat_format_is_cached_and_finds_end_of_turn(tok):
    fmt = chat_format(tok, TOOLS)
    assert chat_format(tok, json.loads(json.dumps(TOOLS))) is fmt
    assert chat_format(tok, None) is not fmt
    assert (fmt.end_of_turn, fmt.end_of_turn_id) == ("<|im_end|>", IM_END_ID)


# A Qwen2.5-style ChatML template: newline after every turn, tools as JSON in the system turn,
# one "tool" turn per response; its eos token is not the end-of-turn token.
QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_start|>system\n{{ m['content'] }}"
    "{% if tools %}\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_any_prefix_consistent_template_works(tok):
    other = copy.deepcopy(tok)
    other.add_special_tokens({"eos_token": "<|endoftext|>"})
    other.chat_template = QWEN_STYLE_TEMPLATE
    fmt = ChatFormat(other, TOOLS)
    # Found in the template, not taken from eos_token.
    assert (fmt.end_of_turn, fmt.end_of_turn_id) == ("<|im_end|>", IM_END_ID)
    a1, a2 = call("up"), "ANSWER: Pete Docter"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Up?"}]
    ids = fmt.prompt_ids(messages) + sampled_turn(other, a1) + observation_ids(fmt, ["Pete Docter"]) + sampled_turn(other, a2)
    messages += [{"role": "assistant", "content": a1}, {"role": "tool", "content": "Pete Docter"}, {"role": "assistant", "content": a2}]
    # The template ends a turn with "<|im_end|>\n": the sequence stops at the sampled end-of-turn.
    full = other.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    assert decode(other, ids) + "\n" == full


def test_template_that_is_not_prefix_consistent_is_rejected(tok):
    class Shuffled:
        """A tokenizer whose template renders the conversation newest-first."""

        eos_token = tok.eos_token
        all_special_tokens = tok.all_special_tokens

        def apply_chat_template(self, messages, tools, add_generation_prompt, tokenize):
            return tok.apply_chat_template(messages[::-1], tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize)

        def encode(self, text, add_special_tokens):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    with pytest.raises(TemplateError, match="prefix-consistent"):
        ChatFormat(Shuffled(), TOOLS)


# --- play_episodes with ScriptedEngine ------------------------------------------------------------


def test_scripted_episode_is_the_template_rendering_and_masks_only_model_tokens(tok):
    factory = EnvFactory()
    a1, a2 = call("alien"), "ANSWER: Ridley Scott"
    engine = ScriptedEngine(tok, {"Who directed Alien?": [a1, a2]}, version=3)
    [traj] = play_episodes(engine, tok, factory, [task("alien")], PARAMS, max_turns=4, max_total_tokens=1000)

    assert (traj.stop_reason, traj.reward, traj.num_turns) == ("answer", 1.0, 2)
    assert traj.reward_parts == {"outcome": 1.0}
    assert traj.env_info == {"success": 1, "reward_parts": {"outcome": 1.0}, "turns": 2, "no_call_turns": 0}
    assert (traj.task_id, traj.group_id) == ("t-alien", "t-alien")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Who directed Alien?"},
        {"role": "assistant", "content": a1},
        {"role": "tool", "content": "Ridley Scott"},
        {"role": "assistant", "content": a2},
    ]
    rendered = render(tok, messages, add_generation_prompt=False)
    assert decode(tok, traj.tokens) == rendered[: rendered.rindex("<|im_end|>") + len("<|im_end|>")]
    # loss_mask is 1 exactly on the two scripted turns (their text + end-of-turn).
    fmt = chat_format(tok, TOOLS)
    prompt = fmt.prompt_ids(messages[:2])
    obs = observation_ids(fmt, ["Ridley Scott"])
    t1, t2 = sampled_turn(tok, a1), sampled_turn(tok, a2)
    assert traj.tokens == prompt + t1 + obs + t2
    assert traj.loss_mask == [0] * len(prompt) + [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    assert traj.policy_version == [NO_VERSION] * len(prompt) + [3] * len(t1) + [NO_VERSION] * len(obs) + [3] * len(t2)
    assert traj.behavior_logprobs == [0.0] * len(traj.tokens)
    # The environment saw the parsed call, and the turn text without the end-of-turn token.
    first = factory.envs[0].actions[0]
    assert first.text == a1 and first.tool_calls[0].arguments == {"key": "alien"}


def test_malformed_and_unknown_tool_calls_become_observations_and_loop_continues(tok):
    factory = EnvFactory()
    bad = '<tool_call>{"name": "lookup", "arguments": {"key": }</tool_call>'
    unknown = call("alien", name="delete_everything")
    script = [bad, unknown, call("heat"), "ANSWER: Michael Mann"]
    engine = ScriptedEngine(tok, {"Heat": script})
    [traj] = play_episodes(engine, tok, factory, [task("heat")], PARAMS, max_turns=6, max_total_tokens=2000)

    assert (traj.stop_reason, traj.reward, traj.num_turns) == ("answer", 1.0, 4)
    # A malformed call is a call: no turn here went without one.
    assert traj.env_info["no_call_turns"] == 0
    actions = factory.envs[0].actions
    assert len(actions[0].parse_errors) == 1 and actions[0].tool_calls == []
    text = decode(tok, traj.tokens)
    assert f"<tool_response>\nerror: {actions[0].parse_errors[0]}\n</tool_response>" in text
    assert "error: unknown tool 'delete_everything'" in text


def test_turn_without_observation_gets_continue_message(tok):
    engine = ScriptedEngine(tok, {"Up": ["Let me think.", "ANSWER: Pete Docter"]})
    [traj] = play_episodes(engine, tok, EnvFactory(), [task("up")], PARAMS, max_turns=3, max_total_tokens=1000)
    expected = (
        chat_format(tok, TOOLS).prompt_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Up?"}])
        + sampled_turn(tok, "Let me think.")
        + user_message_ids(chat_format(tok, TOOLS), CONTINUE_MESSAGE)
        + sampled_turn(tok, "ANSWER: Pete Docter")
    )
    assert traj.tokens == expected and traj.stop_reason == "answer"
    # The prose turn got the nudge; the answer turn ended the episode and is not counted.
    assert traj.env_info["no_call_turns"] == 1


def test_turns_without_a_call_are_counted_up_to_the_turn_limit(tok):
    engine = ScriptedEngine(tok, {"Up": ["Let me think.", call("up"), "Hmm.", "Still thinking."]})
    [traj] = play_episodes(engine, tok, EnvFactory(), [task("up")], PARAMS, max_turns=4, max_total_tokens=2000)
    assert (traj.stop_reason, traj.num_turns) == ("max_turns", 4)
    assert traj.env_info["no_call_turns"] == 3


def test_turn_limit_calls_finish_and_ends_on_the_model_turn(tok):
    factory = EnvFactory()
    engine = ScriptedEngine(tok, {"Alien": [call("alien")] * 10})
    [traj] = play_episodes(engine, tok, factory, [task("alien")], PARAMS, max_turns=3, max_total_tokens=5000)
    assert (traj.stop_reason, traj.num_turns, traj.reward) == ("max_turns", 3, 0.0)
    assert factory.envs[0].finished == ["max_turns"] and len(factory.envs[0].actions) == 3
    # No observation after the last turn: the sequence ends on a sampled end-of-turn token.
    assert traj.tokens[-1] == IM_END_ID and traj.loss_mask[-1] == 1
    assert traj.env_info["turns"] == 3


def test_token_budget_is_never_exceeded(tok):
    prompt_len = len(chat_format(tok, TOOLS).prompt_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Alien?"}]))
    turn_len = len(sampled_turn(tok, call("alien")))
    reasons = set()
    for budget in range(prompt_len + 2, prompt_len + 4 * turn_len + 60):
        factory = EnvFactory()
        engine = ScriptedEngine(tok, {"Alien": [call("alien")] * 50})
        [traj] = play_episodes(engine, tok, factory, [task("alien")], PARAMS, max_turns=50, max_total_tokens=budget)
        assert len(traj.tokens) <= budget
        assert traj.stop_reason == "max_tokens" and factory.envs[0].finished == ["max_tokens"]
        assert traj.tokens[-1] == IM_END_ID  # ends on a (sampled or forced) end-of-turn token
        reasons.add(traj.loss_mask[-1])
    assert reasons == {0, 1}  # some budgets cut a turn short (forced end), others do not


def test_engine_ignoring_its_limit_is_cut_to_the_budget(tok):
    engine = FakeEngine(lambda c, i: [5] * 500, ignore_limit=True)
    prompt_len = len(chat_format(tok, TOOLS).prompt_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Alien?"}]))
    [traj] = play_episodes(engine, tok, EnvFactory(), [task("alien")], PARAMS, max_turns=5, max_total_tokens=prompt_len + 20)
    assert len(traj.tokens) <= prompt_len + 20
    assert traj.num_action_tokens <= PARAMS.max_new_tokens


@pytest.mark.parametrize("room", [-5, 0, 1])
def test_prompt_leaving_no_room_for_a_turn_ends_at_once(tok, room):
    prompt_len = len(chat_format(tok, TOOLS).prompt_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Alien?"}]))
    engine, factory = FakeEngine(lambda c, i: [IM_END_ID]), EnvFactory()
    [traj] = play_episodes(engine, tok, factory, [task("alien")], PARAMS, max_turns=5, max_total_tokens=prompt_len + room)
    assert (traj.stop_reason, traj.tokens, traj.num_turns) == ("max_tokens", [], 0)
    assert traj.env_info["prompt_tokens"] == prompt_len and factory.envs[0].finished == ["max_tokens"]
    assert engine.calls == []


def test_scripted_turn_cut_by_max_new_tokens_gets_forced_end_of_turn(tok):
    engine = ScriptedEngine(tok, {"Alien": [call("alien"), "ANSWER: Ridley Scott"]})
    factory = EnvFactory()
    # Room for the call up to its closing tag, which is cut off.
    limit = len(tok.encode(call("alien").removesuffix("</tool_call>"), add_special_tokens=False))
    params = SamplingParams(max_new_tokens=limit)
    [traj] = play_episodes(engine, tok, factory, [task("alien")], params, max_turns=1, max_total_tokens=1000)
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    assert len(sampled) == limit and sampled[-1] == len(traj.tokens) - 2
    assert traj.tokens[-1] == IM_END_ID and traj.loss_mask[-1] == 0
    assert factory.envs[0].actions[0].parse_errors[0].startswith("tool call 1: <tool_call> is never closed")
    assert factory.envs[0].actions[0].cut  # the environment is told the turn did not end on its own


@pytest.mark.parametrize("finish_reason, ends, cut", [
    ("length", False, True),   # the engine stopped at max_new_tokens
    ("stop", True, False),     # the model ended its turn
    ("stop", False, False),    # a caller's stop token ended it: not a cut
])
def test_the_action_says_whether_its_turn_was_cut(tok, finish_reason, ends, cut):
    answer = tok.encode("ANSWER: Ridley Scott", add_special_tokens=False) + ([IM_END_ID] if ends else [])
    factory = EnvFactory()
    play_episodes(FakeEngine(lambda c, i: answer, finish_reason=finish_reason), tok, factory, [task("alien")],
                  PARAMS, 1, 1000)
    assert factory.envs[0].actions[0].cut is cut


# --- play_episodes with FakeEngine ----------------------------------------------------------------


def test_logprobs_and_versions_copied_and_forced_end_on_length(tok):
    answer = tok.encode("ANSWER: Ridley Scott", add_special_tokens=False)
    engine = FakeEngine(lambda c, i: answer, finish_reason="length")
    [traj] = play_episodes(engine, tok, EnvFactory(), [task("alien")], PARAMS, max_turns=2, max_total_tokens=1000)
    n = len(answer)
    assert traj.stop_reason == "answer" and traj.reward == 1.0
    # Sampled tokens carry the engine's numbers as they are ...
    assert traj.tokens[-n - 1 : -1] == answer
    assert traj.loss_mask[-n - 1 :] == [1] * n + [0]
    assert traj.behavior_logprobs[-n - 1 : -1] == [-0.01 * (k + 1) for k in range(n)]
    assert traj.policy_version[-n - 1 : -1] == [7 + k % 2 for k in range(n)]
    # ... and the end-of-turn the engine did not sample is forced.
    assert (traj.tokens[-1], traj.behavior_logprobs[-1], traj.policy_version[-1]) == (IM_END_ID, 0.0, NO_VERSION)
    assert versions(traj) == {7, 8}
    # The end-of-turn id is always a stop token of the engine call.
    assert IM_END_ID in engine.calls[0][1].stop_token_ids


def test_sampled_end_of_turn_is_not_forced_again_and_ends_the_turn(tok):
    answer = tok.encode("ANSWER: Ridley Scott", add_special_tokens=False) + [IM_END_ID]
    # An engine that ignores stop_token_ids and runs on past the end-of-turn token.
    engine = FakeEngine(lambda c, i: answer + [5, 6, IM_END_ID])
    [traj] = play_episodes(engine, tok, EnvFactory(), [task("alien")], PARAMS, 2, 1000)
    assert traj.tokens[-len(answer) :] == answer and traj.loss_mask[-len(answer) :] == [1] * len(answer)
    assert traj.num_action_tokens == len(answer) and traj.stop_reason == "answer"


# --- batches -------------------------------------------------------------------------------------


def test_env_errors_end_only_their_episode_and_order_is_preserved(tok):
    scripts = {
        "Alien": [call("alien"), "ANSWER: Ridley Scott"],
        "Heat": [call("heat"), call("heat"), "ANSWER: Michael Mann"],
        "Up": ["ANSWER: Pete Docter"],
    }
    tasks = [task("heat"), task("alien", fail_step=2), task("up"), task("alien", fail_reset=True)]
    tasks[3].task_id = "t-alien-2"
    engine = ScriptedEngine(tok, scripts)
    out = play_episodes(engine, tok, EnvFactory(), tasks, PARAMS, max_turns=5, max_total_tokens=2000, group_ids=[t.prompt for t in tasks])

    assert [t.task_id for t in out] == ["t-heat", "t-alien", "t-up", "t-alien-2"]
    assert [t.group_id for t in out] == [t.prompt for t in tasks]
    assert [t.stop_reason for t in out] == ["answer", "error", "answer", "error"]
    assert [t.reward for t in out] == [1.0, 0.0, 1.0, 0.0]
    assert "step exploded" in out[1].env_info["error"] and out[1].num_turns == 2
    assert "reset exploded" in out[3].env_info["error"] and out[3].tokens == []
    # The healthy episodes are exactly what they are when run alone.
    alone = play_episodes(ScriptedEngine(tok, scripts), tok, EnvFactory(), [tasks[0], tasks[2]], PARAMS, 5, 2000)
    assert [out[0].tokens, out[2].tokens] == [t.tokens for t in alone]


def test_batch_decodes_in_lock_step(tok):
    scripts = {"Alien": [call("alien"), "ANSWER: Ridley Scott"], "Heat": [call("heat"), call("heat"), "ANSWER: Michael Mann"], "Up": ["ANSWER: Pete Docter"]}
    calls: list[int] = []

    class Counting(ScriptedEngine):
        def generate(self, prompts, params):
            calls.append(len(prompts))
            return super().generate(prompts, params)

    out = play_episodes(Counting(tok, scripts), tok, EnvFactory(), [task("up"), task("heat"), task("alien")], PARAMS, 5, 2000)
    # The engine client waits until every running episode has asked: one call per turn over every
    # episode still running, exactly as a lock-step loop would batch them.
    assert calls == [3, 2, 1]
    assert [t.num_turns for t in out] == [1, 3, 2]


def test_shaping_rewards_add_up(tok):
    engine = ScriptedEngine(tok, {"Alien": [call("alien"), call("alien"), "ANSWER: Ridley Scott"]})
    [traj] = play_episodes(engine, tok, EnvFactory(), [task("alien", shaping=0.25)], PARAMS, 5, 2000)
    assert traj.reward == 1.5 and traj.reward_parts == {"outcome": 1.0, "shaping": 0.5}


def test_scripted_engine_groups_and_exhausted_scripts(tok):
    # Two rollouts of one task replay the same script; "Up" is a substring of no other key but
    # "Alien" and "Alien 2" overlap, and the longest key that occurs wins.
    scripts = {"Alien": ["ANSWER: Ridley Scott"], "Alien 2": ["ANSWER: James Cameron"], "Up": []}
    tasks = [task("alien"), task("alien"), Task("t-a2", "Who directed Alien 2?", "James Cameron"), task("up")]
    factory = EnvFactory()
    out = play_episodes(ScriptedEngine(tok, scripts), tok, factory, tasks, PARAMS, max_turns=2, max_total_tokens=2000)
    assert [t.reward for t in out] == [1.0, 1.0, 1.0, 0.0]
    # An exhausted script emits empty turns (just the end-of-turn token) until the turn limit.
    assert out[3].stop_reason == "max_turns" and [a.text for a in factory.envs[3].actions] == ["", ""]
    with pytest.raises(KeyError, match="no script key"):
        play_episodes(ScriptedEngine(tok, {"nothing": []}), tok, EnvFactory(), [task("up")], PARAMS, 1, 2000)


def test_episodes_are_the_same_alone_and_batched(tok):
    """Batching concurrent episodes into one decode changes no token of any episode."""
    import asyncio

    from tiderl.agent.loop import play_episode
    from tiderl.rollout.client import BatchingEngine

    scripts = {
        "Who directed Alien?": ["Let me think.\n" + call("alien"), "ANSWER: Ridley Scott"],
        "Who directed Heat?": [call("nope", name="delete"), "hmm", "ANSWER: Pete Docter"],
        "Who directed Up?": [call("up")] * 5,  # runs into the turn limit
    }
    tasks = [task("alien"), task("heat"), task("up", shaping=0.25)]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=[IM_END_ID])
    batched = play_episodes(ScriptedEngine(tok, scripts, version=2), tok, EnvFactory(), tasks, params,
                            max_turns=3, max_total_tokens=400)

    async def one_at_a_time():
        # A client that decodes one request per engine call, episodes interleaving at random.
        client = BatchingEngine(ScriptedEngine(tok, scripts, version=2), max_batch_size=1)
        client.start()
        try:
            return await asyncio.gather(*(play_episode(client, tok, EnvFactory(), t, params, 3, 400)
                                          for t in tasks))
        finally:
            await client.close()

    alone = asyncio.run(one_at_a_time())
    for a, b in zip(batched, alone):
        assert (a.tokens, a.loss_mask, a.behavior_logprobs, a.policy_version) == \
               (b.tokens, b.loss_mask, b.behavior_logprobs, b.policy_version)
        assert (a.reward, a.reward_parts, a.stop_reason, a.num_turns) == \
               (b.reward, b.reward_parts, b.stop_reason, b.num_turns)
    assert [t.stop_reason for t in alone] == ["answer", "answer", "max_turns"]
    assert alone[2].reward_parts["shaping"] == pytest.approx(0.75)  # three tool steps, 0.25 each
