"""The multi-turn agent loop: episodes of (model turn -> tool calls -> environment answer).

`play_episode` is the one episode runner: a coroutine that plays one task at its own pace,
asking a `BatchingEngine` for each model turn; `play_episodes` runs a list of tasks through it
from plain code. `ScriptedEngine` is an `Engine` that replays given assistant texts; it builds
supervised warm-start data and drives the tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tiderl.agent.chat import CONTINUE_MESSAGE, ChatFormat, TemplateError, chat_format
from tiderl.agent.tool_parser import parse_tool_calls, tool_call_format_of
from tiderl.aio import InlineExecutor
from tiderl.envs.protocol import Action, Env, StepResult, Task
from tiderl.models.vision import PromptImages, split_processor
from tiderl.rollout.base import Completion, Engine, SamplingParams, episode_seed
from tiderl.rollout.client import BatchingEngine
from tiderl.types import TokenRecord, Trajectory

logger = logging.getLogger(__name__)

__all__ = ["CONTINUE_MESSAGE", "ScriptedEngine", "play_episode", "play_episodes"]


@dataclass
class _Episode(TokenRecord):
    """The running state of one task's episode."""

    task: Task
    group_id: str
    env: Env | None = None
    fmt: ChatFormat | None = None
    num_turns: int = 0
    # Turns with neither a tool call nor a malformed one that did not end the episode (they got
    # the environment's nudge): what `env.no_call_penalty` charges.
    no_call_turns: int = 0
    # Sum of the rewards of non-final steps (shaping); added to the final reward.
    shaping: float = 0.0
    trajectory: Trajectory | None = None
    # The images shown so far, in the order of their placeholder tokens in `tokens`.
    images: list[Any] = dataclasses.field(default_factory=list)

    def close(self, reward: float, reward_parts: dict[str, float], env_info: dict[str, Any], stop_reason: str) -> None:
        """Freeze the episode into its Trajectory."""
        self.trajectory = Trajectory(
            tokens=self.tokens,
            loss_mask=self.loss_mask,
            behavior_logprobs=self.behavior_logprobs,
            policy_version=self.policy_version,
            reward=reward,
            reward_parts=reward_parts,
            task_id=self.task.task_id,
            group_id=self.group_id,
            env_info={**env_info, "turns": self.num_turns, "no_call_turns": self.no_call_turns},
            num_turns=self.num_turns,
            stop_reason=stop_reason,
            images=list(self.images),
        )

    def close_with(self, result: StepResult, stop_reason: str) -> None:
        """Close on the environment's final StepResult (from `step` or `finish`)."""
        parts = dict(result.info.get("reward_parts", {"outcome": result.reward}))
        if self.shaping:
            parts["shaping"] = parts.get("shaping", 0.0) + self.shaping
        self.close(result.reward + self.shaping, parts, dict(result.info), stop_reason)

    def fail(self, exc: BaseException, where: str) -> None:
        """Close as an error: reward 0, the exception in env_info, so the caller can count or
        retry the task."""
        logger.warning("task %s: %s raised %r; episode ends with stop_reason 'error'", self.task.task_id, where, exc, exc_info=exc)
        self.close(0.0, {}, {"error": repr(exc), "error_in": where}, "error")

    def stop_early(self, reason: str) -> None:
        """End without an answer (turn or token limit): the environment scores what there is."""
        assert self.env is not None
        try:
            result = self.env.finish(reason)
        except Exception as exc:  # noqa: BLE001 - one environment's failure must not end the batch
            self.fail(exc, "env.finish")
            return
        self.close_with(result, reason)


def _start(episode: _Episode, tokenizer: Any, make_env: Callable[[], Env], max_total_tokens: int) -> None:
    """Create the environment, reset it and render the prompt (or close the episode)."""
    try:
        episode.env = make_env()
        first_message = episode.env.reset(episode.task)
        system = episode.env.system_prompt()
        tools = episode.env.tool_schemas()
    except Exception as exc:  # noqa: BLE001 - one environment's failure must not end the batch
        episode.fail(exc, "env setup (make_env/reset/system_prompt/tool_schemas)")
        return
    try:
        episode.fmt = chat_format(tokenizer, tools)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": first_message}]
        prompt, images = episode.fmt.prompt_with_images(messages)
    except TemplateError:
        raise  # the tokenizer's template cannot be used at all: every episode would fail the same way
    except Exception as exc:  # noqa: BLE001 - e.g. tool schemas that are not JSON: this environment's fault
        episode.fail(exc, "rendering the prompt")
        return
    if len(prompt) + 2 > max_total_tokens:
        # Not even one sampled token (plus a forced end-of-turn) fits: no tokens are kept, as
        # a cut prompt is not a conversation; the environment still gets to close the episode.
        episode.stop_early("max_tokens")
        assert episode.trajectory is not None
        episode.trajectory.env_info["prompt_tokens"] = len(prompt)
        return
    episode.append_forced(prompt)
    episode.images += images


def _append_turn(episode: _Episode, completion: Completion, limit: int, tokenizer: Any) -> Action:
    """Append the kept sampled tokens of one turn (plus a forced end-of-turn when it was cut)
    and return the parsed Action the environment will see."""
    assert episode.env is not None and episode.fmt is not None
    end_id = episode.fmt.end_of_turn_id
    n = len(completion.token_ids)
    if len(completion.logprobs) != n or len(completion.policy_version) != n:
        raise ValueError(
            f"engine completion has {n} tokens, {len(completion.logprobs)} logprobs and "
            f"{len(completion.policy_version)} versions: an engine must return one of each per token"
        )
    # Keep at most `limit` tokens and nothing after an end-of-turn token (an engine that ignores
    # stop_token_ids would otherwise make the turn run into the next one).
    keep = min(n, limit)
    if end_id in completion.token_ids[:keep]:
        keep = completion.token_ids.index(end_id) + 1
    ids = list(completion.token_ids[:keep])
    episode.append_sampled(ids, list(completion.logprobs[:keep]), list(completion.policy_version[:keep]))
    if not ids or ids[-1] != end_id:
        episode.append_forced([end_id])
    episode.num_turns += 1

    # Decoding (not re-tokenizing) the sampled ids is how the environment gets to read them.
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # Cut: stopped by a token limit, not by the model (a caller's own stop token is not a cut).
    cut = ids[-1:] != [end_id] and (completion.finish_reason == "length" or keep < n)
    action = parse_tool_calls(text, tool_call_format_of(tokenizer), strip=(episode.fmt.end_of_turn,))
    return dataclasses.replace(action, cut=cut)


def _apply_result(episode: _Episode, result: StepResult, max_turns: int, max_total_tokens: int,
                  action: Action | None = None) -> None:
    """Close the episode on `result`, or append the environment's answer for the next turn."""
    assert episode.fmt is not None
    if result.done:
        episode.close_with(result, "answer")
        return
    # A turn without any tool call (well-formed or not) that was not accepted as an answer.
    called = action is None or bool(action.tool_calls or action.parse_errors)
    if not called:
        episode.no_call_turns += 1
    episode.shaping += result.reward
    if episode.num_turns >= max_turns:
        episode.stop_early("max_turns")
        return
    # A turn without any tool call has nothing for a tool response to answer: the environment's
    # nudge ("no tool call ...") goes back as a user turn, as a chat model expects.
    try:
        answer, images = episode.fmt.answer_with_images(result.observations, as_tool_responses=called)
    except TemplateError:
        raise  # the tokenizer's template cannot be used at all: every episode would fail the same way
    except Exception as exc:  # noqa: BLE001 - one environment's answer must not end the batch
        episode.fail(exc, "rendering the environment's answer")
        return
    # The next turn needs room for one sampled token and a possible forced end-of-turn.
    if len(episode.tokens) + len(answer) + 2 > max_total_tokens:
        episode.stop_early("max_tokens")
        return
    episode.append_forced(answer)
    episode.images += images


async def play_episode(
    client: BatchingEngine,
    tokenizer: Any,
    make_env: Callable[[], Env],
    task: Task,
    params: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
    group_id: str | None = None,
) -> Trajectory:
    """Play one episode, turn after turn, at its own pace, and return its Trajectory.

    tiderl's one episode runner (training on every backend, evaluation, demonstrations, value
    pretraining). Each model turn awaits `client.generate` (concurrent episodes decode together);
    each environment call runs in a worker thread (or awaits `env.astep`), so a slow tool blocks
    only its own episode. docs/extending.md ("How the agent loop plays an episode") states the
    whole contract; in short:
    - sampled ids are kept as sampled (loss_mask 1), never re-tokenized; prompt and answers are
      the chat template's (loss_mask 0); a turn that stops without the end-of-turn token gets it
      as a forced token;
    - `len(tokens) <= max_total_tokens` and at most `max_turns` turns; at a limit
      `env.finish(reason)` scores the episode (stop_reason "max_tokens" / "max_turns"), an
      answer ends it with "answer" (reward: the final one plus earlier shaping rewards);
    - an exception of the environment ends only its episode (stop_reason "error", reward 0,
      env_info["error"]); engine and template (`TemplateError`) errors propagate;
    - group_id = `group_id` or task.task_id;
    - with a vision-language processor as `tokenizer`, an environment's `Observation`s show
      images: their placeholder tokens are forced, the images go to `Trajectory.images` in token
      order and to every `client.generate` of the episode (docs/multimodal.md).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: an episode needs at least one model turn; use max_turns >= 1")
    if max_total_tokens < 2:
        raise ValueError(f"max_total_tokens={max_total_tokens} leaves no room for a turn; use a larger budget")
    episode = _Episode(task=task, group_id=group_id or task.task_id)
    text_tokenizer, _ = split_processor(tokenizer)
    with client.episode():
        with client.in_env():
            await asyncio.to_thread(_start, episode, tokenizer, make_env, max_total_tokens)
        while episode.trajectory is None:
            assert episode.fmt is not None and episode.env is not None
            limit = min(params.max_new_tokens, max_total_tokens - len(episode.tokens) - 1)
            stops = list(params.stop_token_ids)  # the caller's, plus the end-of-turn token
            if episode.fmt.end_of_turn_id not in stops:
                stops.append(episode.fmt.end_of_turn_id)
            call_params = dataclasses.replace(params, max_new_tokens=limit, stop_token_ids=stops)
            # Only an episode with images passes them: the text-only request stays what it was.
            with_images = {"images": PromptImages(list(episode.images), [1 - m for m in episode.loss_mask])
                           } if episode.images else {}
            completion = await client.generate(list(episode.tokens), call_params, **with_images)
            action = _append_turn(episode, completion, limit, text_tokenizer)
            with client.in_env():
                try:
                    astep = getattr(episode.env, "astep", None)
                    if astep is not None:
                        result = await astep(action)
                    else:
                        result = await asyncio.to_thread(episode.env.step, action)
                except Exception as exc:  # noqa: BLE001 - one environment's failure ends only its episode
                    episode.fail(exc, "env.step")
                    break
                _apply_result(episode, result, max_turns, max_total_tokens, action)
    assert episode.trajectory is not None
    return episode.trajectory


def play_episodes(
    engine: Engine,
    tokenizer: Any,
    make_env: Callable[[], Env],
    tasks: list[Task],
    params: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
    group_ids: list[str] | None = None,
    max_batch_size: int = 64,
    threads: int = 0,
    on_episode: Callable[[int, Trajectory], None] | None = None,
    max_in_flight: int | None = None,
) -> list[Trajectory]:
    """Play one episode per task concurrently (`play_episode`) on `engine`; blocking.

    At most `max_in_flight` episodes are under way at once (None: twice `max_batch_size`, which
    keeps the decode slots full while some episodes wait on their tools; 0: all of them), the
    next task starting as one ends (why not all at once: docs/real_models.md, "episodes in
    flight are bounded").

    Returns the trajectories in the order of `tasks`; `group_ids[i]` (default: the task id)
    becomes trajectory i's group_id. Runs its own event loop; called from inside a running one
    (a training observer, say) it blocks that loop until its episodes are done. The engine
    decodes in the loop's own thread (`InlineExecutor`: nothing else runs torch meanwhile) with
    `threads` torch threads (0 = the cores other processes leave free). `on_episode(i, trajectory)`
    is called as each episode ends (i = its index in `tasks`), for progress displays.

    With `params.seed` set, each episode samples from its own stream, `episode_seed(params.seed,
    "<task id>#<k>")` for the k-th episode of that task id in `tasks`, so its random draws do not
    depend on the batch size, the number in flight, the order of `tasks` or how fast tools
    answer (the logits' rounding still may, in bf16).
    """
    if group_ids is not None and len(group_ids) != len(tasks):
        raise ValueError(f"{len(group_ids)} group ids for {len(tasks)} tasks: give one per task")
    per_episode = [params] * len(tasks)
    if params.seed is not None:
        seen: dict[str, int] = {}
        for i, task in enumerate(tasks):
            k = seen[task.task_id] = seen.get(task.task_id, -1) + 1
            per_episode[i] = dataclasses.replace(params, seed=episode_seed(params.seed, f"{task.task_id}#{k}"))

    async def main() -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        # One thread per episode for environment calls, so no episode waits for a free thread.
        loop.set_default_executor(ThreadPoolExecutor(max(4, min(len(tasks), 256)), thread_name_prefix="tiderl-env"))
        client = BatchingEngine(engine, max_batch_size, executor=InlineExecutor(threads))
        client.start()
        limit = 2 * max_batch_size if max_in_flight is None else max_in_flight
        slots = asyncio.Semaphore(limit if limit > 0 else len(tasks) or 1)

        async def one(i: int, task: Task) -> Trajectory:
            async with slots:  # tasks start in order as earlier episodes end
                trajectory = await play_episode(client, tokenizer, make_env, task, per_episode[i], max_turns,
                                                max_total_tokens, group_id=group_ids[i] if group_ids else None)
            if on_episode is not None:
                on_episode(i, trajectory)
            return trajectory

        try:
            return list(await asyncio.gather(*(one(i, task) for i, task in enumerate(tasks))))
        finally:
            await client.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    # Called from inside an event loop (e.g. a training observer): run on a helper thread with its
    # own loop; the caller's loop waits until the episodes are done.
    with ThreadPoolExecutor(1, thread_name_prefix="tiderl-episodes") as pool:
        return pool.submit(asyncio.run, main()).result()


class ScriptedEngine:
    """An Engine that emits given assistant turns instead of sampling.

    `turns_by_prompt` maps a key to the assistant texts of one episode, in turn order. The key
    is any text of the episode's first prompt that identifies it (the task's question); when
    several occur, the longest wins ("q1" inside "q10"). A later prompt continues the episode
    whose last prompt + completion it extends; several episodes with one key (a group of
    rollouts of one task) each replay the script.

    A completion is the turn text's tokens plus the tokenizer's `eos_token` (which must be the
    template's end-of-turn token), cut to `params.max_new_tokens` (finish_reason "length");
    log-probs 0.0, every token of version `self.version`. Past the end of its script an episode
    gets an empty turn (the end-of-turn token alone), so it runs into the turn limit rather than
    crashing the batch. Matching costs one comparison per episode seen so far: use one engine
    per batch of tasks for a large data set.
    """

    def __init__(self, tokenizer: Any, turns_by_prompt: dict[str, list[str]], version: int = 0):
        if tokenizer.eos_token is None:
            raise ValueError("ScriptedEngine needs a tokenizer with an eos_token (the end-of-turn token)")
        self.tokenizer = tokenizer
        self.turns_by_prompt = turns_by_prompt
        self.version = version
        self._eos_id: int = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        # One entry per episode seen: (script key, turns emitted, prompt + last completion).
        self._episodes: list[tuple[str, int, list[int]]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[Any] | None = None) -> list[Completion]:
        """Emit the next scripted turn of each prompt's episode (`images`, of an episode that shows
        some, are taken and not looked at: a script replays the same turns whatever it is shown)."""
        claimed: set[int] = set()
        completions = []
        for prompt in prompts:
            slot = self._find_episode(prompt, claimed)
            if slot is None:
                key = self._key_for(prompt)
                self._episodes.append((key, 0, []))
                slot = len(self._episodes) - 1
            claimed.add(slot)
            key, turn, _ = self._episodes[slot]
            script = self.turns_by_prompt[key]
            text = script[turn] if turn < len(script) else ""
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self._eos_id]
            finish_reason = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish_reason = ids[: params.max_new_tokens], "length"
            self._episodes[slot] = (key, turn + 1, list(prompt) + ids)
            completions.append(
                Completion(
                    token_ids=ids,
                    logprobs=[0.0] * len(ids),
                    text=self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                    finish_reason=finish_reason,
                    policy_version=[self.version] * len(ids),
                )
            )
        return completions

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """A script has no weights; only the version that tags its tokens changes."""
        self.version = version

    def state_checksum(self) -> float:
        """A script has no weights: the checksum of an empty state."""
        return 0.0

    def _find_episode(self, prompt: list[int], claimed: set[int]) -> int | None:
        """The unclaimed episode whose last prompt + completion `prompt` extends (the longest)."""
        best, best_len = None, 0
        for slot, (_, _, seen) in enumerate(self._episodes):
            if slot not in claimed and seen and len(seen) > best_len and prompt[: len(seen)] == seen:
                best, best_len = slot, len(seen)
        return best

    def _key_for(self, prompt: list[int]) -> str:
        """The longest script key that occurs in a new episode's first prompt."""
        text = self.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        keys = [k for k in self.turns_by_prompt if k in text]
        if not keys:
            raise KeyError(f"no script key occurs in the prompt {text[-200:]!r}; ScriptedEngine keys: {list(self.turns_by_prompt)[:5]}")
        return max(keys, key=len)
