"""Held-out evaluation: run a policy (or the scripted oracle) on tasks it never trained on.

`evaluate` plays every task through the agent loop (`play_episodes`) and summarises the episodes
(`tiderl.metrics.summary`: success, pass@k, turns, tokens, ...) overall, per number of hops and
per answer type; docs/evaluation.md defines every number. The oracle (`Setup.oracle`,
`oracle_engine`) replays each task's scripted solution through the very same `evaluate`, so its
success is the ceiling of the environment with these labels. Also here: the tables, the progress
bar and the transcripts of an evaluation, and the training transcripts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
    on_episode: Callable[[Task, Trajectory], None] | None = None,
) -> list[list[Trajectory]]:
    """`samples_per_task` episodes of every task (group_id = task_id), one list per task in
    task order. Tasks run in chunks of `chunk_size` (0 = all at once, one `play_episodes`
    call). `engine` is an Engine, or an `EngineFor` giving a fresh engine per chunk, in which
    case a chunk also never holds two tasks with the same prompt. `on_episode(task, trajectory)`
    is called as each episode ends (progress, transcripts)."""
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be >= 1, got {samples_per_task}")
    per_chunk = not hasattr(engine, "generate")
    groups: list[list[Trajectory]] = []
    for chunk in _chunks(tasks, chunk_size, distinct_prompts=per_chunk):
        chunk_engine = engine(chunk) if per_chunk else engine
        copies = [t for t in chunk for _ in range(samples_per_task)]
        report = None if on_episode is None else (
            lambda i, trajectory, copies=copies: on_episode(copies[i], trajectory))
        trajectories = play_episodes(chunk_engine, tokenizer, make_env, copies, params,
                                     max_turns=env_cfg.max_turns, max_total_tokens=env_cfg.max_total_tokens,
                                     max_batch_size=getattr(chunk_engine, "max_batch_size", len(copies)),
                                     on_episode=report)
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
    on_episode: Callable[[Task, Trajectory], None] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Run every task and summarise (`summarize_samples`), overall, per number of hops
    (`by_hops`, when tasks have `meta["hops"]`) and per answer type (`by_type`, when tasks have
    `meta["answer_type"]`).

    greedy: temperature 0, one episode per task. Otherwise `samples_per_task` episodes per task
    at the rollout temperature, and pass@k with k = samples_per_task when it is above 1.
    `mode` names which ("greedy" or "sampled(T=...)"). `engine` and `chunk_size`: see
    `run_samples`; so is `on_episode`. The result's "by_stop_reason" is `stop_reason_rows`.
    seed: when set, each sampled episode draws from its own stream (`play_episodes`), so its
    random draws do not depend on how episodes are batched (in bf16 the logits' rounding still
    may: docs/evaluation.md).
    """
    samples = 1 if greedy else samples_per_task
    params = dataclasses.replace(sampling_params(rollout, tokenizer.eos_token_id, greedy), seed=seed)
    groups = run_samples(engine, tokenizer, make_env, tasks, params, env_cfg, samples, chunk_size, on_episode)
    result = summarize_samples(groups, samples)
    result["mode"] = "greedy" if greedy else f"sampled(T={rollout.temperature})"
    result["by_stop_reason"] = stop_reason_rows([t for group in groups for t in group])
    for key, meta_key in (("by_hops", "hops"), ("by_type", "answer_type")):
        if any(meta_key in t.meta for t in tasks):
            split: dict[str, list[list[Trajectory]]] = {}
            for task, group in zip(tasks, groups):
                split.setdefault(str(task.meta.get(meta_key, "?")), []).append(group)
            result[key] = {name: summarize_samples(gs, samples) for name, gs in sorted(split.items())}
    return result


def evaluate_modes(cfg: Any, engine: Engine | EngineFor, tokenizer: Any, make_env: Callable[[], Env],
                   tasks: list[Task], chunk_size: int = 0, watch: Callable[[str, int], Any] | None = None,
                   oracle: bool = False) -> dict[str, dict[str, Any]]:
    """`evaluate` in the modes the config's `eval` section asks for: "greedy" (eval.greedy) and
    "sampled" (eval.sampled, eval.pass_k samples per task; also when only eval.pass_k > 1 asks for
    it), seeded with `cfg.seed`. With `oracle` (a scripted engine), greedy only: a script is
    deterministic. `watch(mode, episodes)`, when given, returns the `on_episode` callback of that
    mode's run (an `EvalProgress`), closed afterwards."""
    modes = {"greedy": (True, 1)} if cfg.eval.greedy or oracle else {}
    if not oracle and (cfg.eval.sampled or cfg.eval.pass_k > 1):
        modes["sampled"] = (False, cfg.eval.pass_k)
    out = {}
    for mode, (greedy, samples) in modes.items():
        watcher = watch(mode, len(tasks) * samples) if watch else None
        try:
            out[mode] = evaluate(engine, tokenizer, make_env, tasks, cfg.env, cfg.rollout, greedy,
                                 samples_per_task=samples, chunk_size=chunk_size, on_episode=watcher, seed=cfg.seed)
        finally:
            if watcher is not None:
                watcher.close()
    return out


def held_out_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`evaluate_modes`' results as metrics (docs/metrics.md): `eval/<mode>/success` and
    `eval/<mode>/success_se` per mode (and `eval/<mode>/pass_at_k` with eval.pass_k > 1), and
    `eval/success`, `eval/success_se`: the first mode's (greedy when it runs)."""
    out: dict[str, float] = {}
    for mode, r in results.items():
        out |= {f"eval/{mode}/success": r["success"], f"eval/{mode}/success_se": r["stderr"]}
        out |= {f"eval/{mode}/pass_at_k": r["pass_at_k"]} if "pass_at_k" in r else {}
    first = next(iter(results))
    return {"eval/success": out[f"eval/{first}/success"], "eval/success_se": out[f"eval/{first}/success_se"], **out}


# -- the oracle ----------------------------------------------------------------------------


def oracle_engine(tokenizer: Any, scripts: dict[str, list[str]]) -> EngineFor:
    """An `EngineFor` that replays `scripts` (task_id -> turns): a `ScriptedEngine` per chunk
    of tasks, keyed by their prompts."""
    return lambda chunk: ScriptedEngine(tokenizer, {t.prompt: scripts[t.task_id] for t in chunk})


def oracle_limits(env_cfg: EnvConfig, rollout: RolloutConfig,
                  scripts: dict[str, list[str]]) -> tuple[EnvConfig, RolloutConfig]:
    """Episode limits under which no oracle script is cut: as many turns as the longest script
    (at least `env.max_turns`) and no practical token limit (`ORACLE_TOKEN_LIMIT`)."""
    longest = max((len(s) for s in scripts.values()), default=1)
    env = dataclasses.replace(env_cfg, max_turns=max(env_cfg.max_turns, longest),
                              max_total_tokens=ORACLE_TOKEN_LIMIT)
    return env, dataclasses.replace(rollout, max_new_tokens=ORACLE_TOKEN_LIMIT)


# -- memory ---------------------------------------------------------------------------------

# How often `trimmed_heap` returns the C heap's free pages (seconds).
HEAP_TRIM_INTERVAL_S = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


@contextlib.contextmanager
def trimmed_heap(interval_s: float = HEAP_TRIM_INTERVAL_S) -> Iterator[list[int]]:
    """While the block runs, return the C heap's free pages to the OS every `interval_s` seconds
    (glibc's `malloc_trim(0)`, from a thread of its own; nothing where the C library lacks it).
    Yields a one-element list: the number of trims done so far. Why: the KV caches of turns that
    come and go leave free holes in glibc's heap that it keeps resident (docs/engines.md)."""
    calls = [0]
    trim = _malloc_trim()
    if trim is None or interval_s <= 0:
        yield calls
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            trim(0)
            calls[0] += 1

    thread = threading.Thread(target=loop, name="tiderl-heap-trim", daemon=True)
    thread.start()
    try:
        yield calls
    finally:
        stop.set()
        thread.join()


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


# -- watching an evaluation: progress, stop reasons, transcripts ------------------------------


class EvalProgress:
    """An `on_episode` callback that shows a progress bar (tqdm, on stderr) with the running
    success rate and stop reasons, and keeps the first `keep` (task, trajectory) pairs for
    transcripts."""

    def __init__(self, total: int, label: str, enabled: bool = True, keep: int = 0):
        self.done, self.successes = 0, 0
        self.keep = keep
        self.kept: list[tuple[Task, Trajectory]] = []
        self.stop_reasons: Counter[str] = Counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            # A terminal gets a live bar; a log file a line every 30 s at most.
            interval = 0.5 if sys.stderr.isatty() else 30.0
            self.bar = tqdm(total=total, desc=f"eval {label}", unit="ep", file=sys.stderr,
                            mininterval=interval, maxinterval=max(interval, 10.0), dynamic_ncols=True)

    def __call__(self, task: Task, trajectory: Trajectory) -> None:
        self.done += 1
        self.successes += int(bool(trajectory.env_info.get("success", 0)))
        self.stop_reasons[trajectory.stop_reason] += 1
        if len(self.kept) < self.keep:
            self.kept.append((task, trajectory))
        if self.bar is not None:
            self.bar.set_postfix_str(self.status(), refresh=False)
            self.bar.update(1)

    def status(self) -> str:
        """"success 0.420, answer 30, max_turns 12": the running success and stop reasons."""
        rate = self.successes / self.done if self.done else 0.0
        return ", ".join([f"success {rate:.3f}"] + [f"{k} {v}" for k, v in sorted(self.stop_reasons.items())])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def stop_reason_rows(trajectories: list[Trajectory]) -> dict[str, dict[str, float]]:
    """Per stop reason ("answer", "max_turns", "max_tokens", "error", ...), most frequent first:
    episodes, their share, success rate, mean turns, tokens and generated (sampled) tokens."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.stop_reason, []).append(t)
    n = len(trajectories)
    return {
        reason: {
            "episodes": len(ts),
            "share": len(ts) / n,
            "success": sum(bool(t.env_info.get("success", 0)) for t in ts) / len(ts),
            "turns": sum(t.num_turns for t in ts) / len(ts),
            "tokens": sum(len(t.tokens) for t in ts) / len(ts),
            "gen_tokens": sum(sum(t.loss_mask) for t in ts) / len(ts),
        }
        for reason, ts in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    }


def stop_reason_table(rows: dict[str, dict[str, float]]) -> str:
    """`stop_reason_rows` as a Markdown table."""
    lines = ["| stop reason | episodes | share | success | turns | tokens | gen. tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for reason, r in rows.items():
        lines.append(f"| {reason} | {r['episodes']} | {r['share']:.3f} | {r['success']:.3f} | {r['turns']:.2f} "
                     f"| {r['tokens']:.1f} | {r['gen_tokens']:.1f} |")
    return "\n".join(lines)


def transcript(tokenizer: Any, task: Task | None, trajectory: Trajectory) -> dict[str, Any]:
    """One episode as plain data: the task, the outcome, and the conversation as segments
    ("context": prompt and environment answers, not trained on; "model": sampled tokens),
    decoded with special tokens kept so the turn structure stays visible. Joined, the
    segments' texts are the decoded episode. Without `task` (training batches carry only the
    task id) "prompt" and "answer" are None; the prompt is still the first segment."""
    segments: list[dict[str, str]] = []
    mask, start = trajectory.loss_mask, 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            text = tokenizer.decode(trajectory.tokens[start:i], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
            segments.append({"role": "model" if mask[start] else "context", "text": text})
            start = i
    return {
        "task_id": task.task_id if task else trajectory.task_id,
        "prompt": task.prompt if task else None, "answer": task.answer if task else None,
        "reward": trajectory.reward, "success": trajectory.env_info.get("success"),
        "stop_reason": trajectory.stop_reason, "turns": trajectory.num_turns,
        "tokens": len(trajectory.tokens), "gen_tokens": sum(trajectory.loss_mask),
        "env_info": {k: v for k, v in trajectory.env_info.items() if _is_json(v)},
        "segments": segments,
    }


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# Transcript text goes in fences of this many backticks, longer than any run a model writes
# in practice (models write ``` fences themselves).
_FENCE = "`" * 5


def transcripts_markdown(records: list[dict[str, Any]], title: str) -> str:
    """Transcripts (from `transcript`) as a readable Markdown document: per episode a heading
    with the outcome, the prompt folded away, then the model's turns and the environment's
    answers in order."""
    out = [f"# {title}", ""]
    for n, r in enumerate(records, 1):
        outcome = "success" if r["success"] else "failure"
        out += [(f"## {n}. {r['task_id']}: {outcome} ({r['stop_reason']}, {r['turns']} turns, "
                 f"{r['tokens']} tokens)"), ""]
        if r["prompt"] is not None:
            out += [f"- question: {r['prompt']}", f"- answer: {r['answer']}"]
        out += [f"- reward: {r['reward']:.3f}"] + ([f"- step: {r['step']}"] if "step" in r else []) + [""]
        for i, segment in enumerate(r["segments"]):
            body = segment["text"].replace(_FENCE, "`` `` `")
            block = [_FENCE, body, _FENCE, ""]
            if segment["role"] == "model":
                out += ["**model**", ""] + block
            elif i == 0:
                out += ["<details><summary>prompt</summary>", ""] + block + ["</details>", ""]
            else:
                out += ["**environment**", ""] + block
    return "\n".join(out)


def append_training_transcripts(tokenizer: Any, batch: list[Trajectory], step: int, n: int,
                                directory: Path) -> list[Trajectory]:
    """Up to `n` episodes of training step `step`'s batch, rewarded ones first (the rare ones
    worth reading when reward is sparse), then in batch order: appended to
    `directory/train.jsonl` (each record with its "step") and written as
    `directory/train_latest.md`. Returns the episodes written."""
    if n <= 0:
        return []
    picked = sorted(batch, key=lambda t: not t.reward > 0)[:n]  # stable: batch order within each part
    records = [{**transcript(tokenizer, None, t), "step": step} for t in picked]
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "train.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    (directory / "train_latest.md").write_text(transcripts_markdown(records, f"Training step {step}"))
    return picked


def write_transcripts(tokenizer: Any, kept: list[tuple[Task, Trajectory]], prefix: Path,
                      title: str) -> list[Path]:
    """Write `kept` episodes to `<prefix>.jsonl` (one `transcript` per line) and `<prefix>.md`."""
    records = [transcript(tokenizer, task, trajectory) for task, trajectory in kept]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    jsonl, md = prefix.with_name(prefix.name + ".jsonl"), prefix.with_name(prefix.name + ".md")
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    md.write_text(transcripts_markdown(records, title))
    return [jsonl, md]
