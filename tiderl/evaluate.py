"""Held-out evaluation: run a policy (or the scripted oracle) on tasks it never trained on.

`evaluate` plays every task through the agent loop (`play_episodes`) and summarises the
episodes: success with its standard error, F1 (KG), turns, tokens, tool errors, the stop
reasons, pass@k when several samples per task are drawn, and the same per number of hops (KG)
and per answer type (`Task.meta["answer_type"]`: AgentBench DB's INSERT, UPDATE, counting, ...).
`markdown_table` prints the results; docs/evaluation.md defines every number.

The oracle (`Setup.oracle`, `oracle_engine`) replays each task's scripted solution through
a `ScriptedEngine`, through the very same `evaluate`, so its success is the ceiling of the
environment with these labels.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.config import EnvConfig, RolloutConfig
from tiderl.envs.protocol import Env, Task
from tiderl.metrics.summary import pass_at_k, summarize, summarize_samples  # noqa: F401 - re-exported
from tiderl.rollout.base import Engine, SamplingParams, sampling_params
from tiderl.types import Trajectory

# A function that returns a fresh engine for one chunk of tasks (a scripted oracle recognises
# an episode by its question, so each chunk holds distinct questions).
EngineFor = Callable[[list[Task]], Engine]

# Token limits for the oracle: a script has no context limit, and a cut turn would be a wrong one.
ORACLE_TOKEN_LIMIT = 10**9


def _chunks(tasks: list[Task], size: int, distinct_prompts: bool) -> list[list[Task]]:
    """Consecutive chunks of at most `size` tasks (0 = no limit); with `distinct_prompts` a
    chunk never holds two tasks with the same prompt."""
    chunks: list[list[Task]] = [[]]
    prompts: set[str] = set()
    for task in tasks:
        full = size > 0 and len(chunks[-1]) >= size
        if chunks[-1] and (full or (distinct_prompts and task.prompt in prompts)):
            chunks.append([])
            prompts = set()
        chunks[-1].append(task)
        prompts.add(task.prompt)
    return [c for c in chunks if c]


def run_samples(
    engine: Engine | EngineFor,
    tokenizer: Any,
    make_env: Callable[[], Env],
    tasks: list[Task],
    params: SamplingParams,
    env_cfg: EnvConfig,
    samples_per_task: int = 1,
    chunk_size: int = 0,
) -> list[list[Trajectory]]:
    """`samples_per_task` episodes of every task (group_id = task_id), one list per task in
    task order. Tasks run in chunks of `chunk_size` (0 = all at once, one `play_episodes`
    call). `engine` is an Engine, or an `EngineFor` giving a fresh engine per chunk, in which
    case a chunk also never holds two tasks with the same prompt."""
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be >= 1, got {samples_per_task}")
    per_chunk = not hasattr(engine, "generate")
    groups: list[list[Trajectory]] = []
    for chunk in _chunks(tasks, chunk_size, distinct_prompts=per_chunk):
        chunk_engine = engine(chunk) if per_chunk else engine
        copies = [t for t in chunk for _ in range(samples_per_task)]
        trajectories = play_episodes(chunk_engine, tokenizer, make_env, copies, params,
                                     max_turns=env_cfg.max_turns, max_total_tokens=env_cfg.max_total_tokens,
                                     max_batch_size=getattr(chunk_engine, "max_batch_size", len(copies)))
        groups += [trajectories[i:i + samples_per_task]
                   for i in range(0, len(trajectories), samples_per_task)]
    return groups


def evaluate(
    engine: Engine | EngineFor,
    tokenizer: Any,
    make_env: Callable[[], Env],
    tasks: list[Task],
    env_cfg: EnvConfig,
    rollout: RolloutConfig,
    greedy: bool,
    *,
    samples_per_task: int = 1,
    chunk_size: int = 0,
) -> dict[str, Any]:
    """Run every task and summarise (`summarize_samples`), overall, per number of hops
    (`by_hops`, when tasks have `meta["hops"]`) and per answer type (`by_type`, when tasks have
    `meta["answer_type"]`).

    greedy: temperature 0, one episode per task. Otherwise `samples_per_task` episodes per task
    at the rollout temperature, and pass@k with k = samples_per_task when it is above 1.
    `mode` names which ("greedy" or "sampled(T=...)"). `engine` and `chunk_size`: see
    `run_samples`.
    """
    samples = 1 if greedy else samples_per_task
    params = sampling_params(rollout, tokenizer.eos_token_id, greedy)
    groups = run_samples(engine, tokenizer, make_env, tasks, params, env_cfg, samples, chunk_size)
    result = summarize_samples(groups, samples)
    result["mode"] = "greedy" if greedy else f"sampled(T={rollout.temperature})"
    for key, meta_key in (("by_hops", "hops"), ("by_type", "answer_type")):
        if any(meta_key in t.meta for t in tasks):
            split: dict[str, list[list[Trajectory]]] = {}
            for task, group in zip(tasks, groups):
                split.setdefault(str(task.meta.get(meta_key, "?")), []).append(group)
            result[key] = {name: summarize_samples(gs, samples) for name, gs in sorted(split.items())}
    return result


# -- the oracle ----------------------------------------------------------------------------


def oracle_engine(tokenizer: Any, scripts: dict[str, list[str]]) -> EngineFor:
    """An `EngineFor` that replays `scripts` (task_id -> turns): a `ScriptedEngine` per chunk
    of tasks, keyed by their prompts."""
    return lambda chunk: ScriptedEngine(tokenizer, {t.prompt: scripts[t.task_id] for t in chunk})


def oracle_texts(env: Env, tasks: list[Task], scripts: dict[str, list[str]]) -> list[str]:
    """What an oracle episode writes: the system prompt, the tool schemas, the questions and
    the scripted turns (a corpus to train a tokenizer on when no model brings one)."""
    texts = [env.system_prompt(), json.dumps(env.tool_schemas()), "system", "user", "assistant",
             "Tools:", "<tool_response>", "</tool_response>"]
    for task in tasks:
        texts.append(task.prompt)
        texts.extend(scripts[task.task_id])
    return texts


def oracle_limits(env_cfg: EnvConfig, rollout: RolloutConfig,
                  scripts: dict[str, list[str]]) -> tuple[EnvConfig, RolloutConfig]:
    """Episode limits under which no oracle script is cut: as many turns as the longest script
    (at least `env.max_turns`) and no practical token limit (`ORACLE_TOKEN_LIMIT`)."""
    longest = max((len(s) for s in scripts.values()), default=1)
    env = dataclasses.replace(env_cfg, max_turns=max(env_cfg.max_turns, longest),
                              max_total_tokens=ORACLE_TOKEN_LIMIT)
    return env, dataclasses.replace(rollout, max_new_tokens=ORACLE_TOKEN_LIMIT)


# -- tables ---------------------------------------------------------------------------------


def result_rows(results: dict[str, dict[str, Any]], label: Callable[[str], str] = str) -> list[tuple[str, dict[str, Any]]]:
    """(label, result) rows for a table: each mode's overall result, then its per-hop
    (`1-hop`) and per-answer-type rows. `label(mode)` names a mode's rows."""
    rows = []
    for mode, result in results.items():
        name = label(mode)
        rows.append((name, result))
        for hops, r in result.get("by_hops", {}).items():
            rows.append((f"{name}, {hops}-hop", r))
        for kind, r in result.get("by_type", {}).items():
            rows.append((f"{name}, {kind or '(no type)'}", r))
    return rows


def markdown_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """A Markdown table of evaluation results, one row per (label, result): n (tasks),
    success, its standard error, pass@k (when any row has it), F1 (when any row has one),
    mean turns, tokens, generated tokens and tool errors per episode."""
    with_pass = next((r["pass_k"] for _, r in rows if "pass_k" in r), None)
    with_f1 = any(r.get("f1") is not None for _, r in rows)
    header = ["eval", "n", "success", "± se"]
    header += [f"pass@{with_pass}"] if with_pass else []
    header += ["F1"] if with_f1 else []
    header += ["turns", "tokens", "gen. tokens", "tool errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|"]
    for label, r in rows:
        if not r.get("n"):
            continue
        cells = [label, str(r["n"]), f"{r['success']:.3f}", f"{r['stderr']:.3f}"]
        if with_pass:
            cells.append(f"{r['pass_at_k']:.3f}" if "pass_at_k" in r else "-")
        if with_f1:
            cells.append(f"{r['f1']:.3f}" if r.get("f1") is not None else "-")
        cells += [f"{r['turns']:.2f}", f"{r['tokens']:.1f}", f"{r['action_tokens']:.1f}",
                  f"{r['tool_errors']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """A plain-text table of evaluation results, one row per (label, result)."""
    header = f"{'eval':<22}{'n':>5}{'success':>10}{'± se':>8}{'f1':>7}{'turns':>7}{'tokens':>8}"
    lines = [header, "-" * len(header)]
    for label, r in rows:
        f1 = r["f1"] if r.get("f1") is not None else 0.0
        lines.append(
            f"{label:<22}{r['n']:>5}{r['success']:>10.3f}{r['stderr']:>8.3f}{f1:>7.3f}"
            f"{r['turns']:>7.2f}{r['tokens']:>8.1f}"
        )
    return "\n".join(lines)
