"""Resident memory of the torch engine with a real model, against the KV cache its episodes need.

Drives `TorchEngine` (continuous batching, prefix reuse) with Qwen2.5-Coder-0.5B-Instruct (bf16)
on scripted multi-turn episodes shaped like AgentBench DB ones: a chat prompt of about 650 tokens,
3-5 turns, about 60 sampled tokens per turn (greedy, a per-turn `max_new_tokens` so that rows
leave at different steps), and a scripted observation of about 100 tokens appended after each
turn (with the next assistant header, as the agent loop does). The episodes' sessions reuse their
kept caches; a finished episode ends its session. Each setting (8, 16, 32 episodes in flight)
runs in a fresh process, so that its peak resident memory (VmHWM) is its own.

Reported per setting: resident memory once the engine is built (weights), its peak during the
episodes, the peak of the KV bytes the engine holds (batch cache buffers + kept caches, from
`tiderl.lab.engine_memory.kv_memory`), and the KV bytes the rows' tokens need (`needed`). A setting stops and
reports when its resident memory passes `--rss-limit-gb` (default 16).

    .venv/bin/python benchmarks/engine_memory.py                 # 8/16/32 in flight, 3-5 turns
    .venv/bin/python benchmarks/engine_memory.py --quick         # 3 turns of ~20 tokens
    .venv/bin/python benchmarks/engine_memory.py --baseline      # + each setting before the fix
    .venv/bin/python benchmarks/engine_memory.py --profile 16    # + torch.profiler's top memory ops

The baseline (`--baseline`) is the engine as it was before its output head was handed a
contiguous input: the model's `logits_to_keep` slice `[:, -1:]` of the prefill's hidden states,
a strided view, made torch's bf16 CPU projection cost as much as for every prompt position
(minutes and gigabytes at 32 rows; the limit below bounds it).

`--prefill-budget` compares the engine's prefill token budget (`TorchEngine(prefill_tokens=...)`,
`rollout.options.prefill_tokens`): each setting runs with no budget (the baseline, every joining request
prefilled in one forward pass) and with `--prefill-tokens` (default: the engine's default), in
fresh processes, interleaved `--repeats` times. Per run: peak RSS, its growth over the weights
(for the whole run, and until the first requests have joined: the first prefill, the one the
budget bounds; later turns add kept caches and glibc heap holes, which it does not),
the time spent prefilling and the prompt tokens it encoded per second, and the generated tokens
(the same in both up to bf16 near-ties). `--prompt` sets the prompt length (default 650; the
MetaQA evaluation's first prompts are ~1,036 tokens). The last line: the first prefill's growth
over the weights and the whole run's, both with the ratio, and both prefill rates.

    .venv/bin/python benchmarks/engine_memory.py --quick --prefill-budget --in-flight 32 --prompt 1036

`--eval` measures a whole `tiderl eval` instead (the MetaQA config, bf16, 64 held-out tasks with
32 episodes in flight; `--quick`: 16 with 16), each in a fresh process: the baseline is eval as it
was (its engine copied the loaded policy, which eval kept until it returned, and the C heap was
never trimmed), then eval as it is now
(the engine takes the policy over, out of the loader's memory map, and `trimmed_heap` returns
free heap pages every second). Per run: peak resident memory, its anonymous and file-backed
parts at the peak, the resident memory once the engine is built, the success, episodes and
generated tokens (the same in both up to greedy near-ties, which bf16 breaks by which rows share
a batch, i.e. by timing), and how long the heap trims took. Needs the MetaQA data
(`data.data_dir` / $TIDERL_DATA_DIR); without it the script prints why and exits 0.

    .venv/bin/python benchmarks/engine_memory.py --eval            # 64 tasks, 32 in flight
    .venv/bin/python benchmarks/engine_memory.py --eval --quick    # 16 tasks, 16 in flight

`--model` (or $TIDERL_ENGINE_MEMORY_MODEL) names the model directory; without it the script
prints why and exits 0. Last line: per setting the peak RSS (and the baseline's, with the ratio
baseline / now), the peak RSS growth over the weights and the peak KV bytes held; with `--eval`,
the peak RSS of both evaluations and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODEL = Path.home() / ".cache/tiderl/models/qwen2.5-coder-0.5b-instruct"
GB = 1e9

SYSTEM = ("You answer questions about a SQL database (or change it) by calling tools. Make one call "
          "per turn and read its result. ")
QUESTION = ("Table Players has columns Name, Age, Team, Goals, Assists, Position, Country, Salary. "
            "Which players older than {age} from team {team} scored more than {goals} goals?")


def _status_kb(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Reset VmHWM to the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _prompt_tokens(tokenizer, i: int, length: int, rng: random.Random) -> list[int]:
    """A chat prompt of about `length` tokens: the system text padded with schema-like lines."""
    lines = [SYSTEM]
    while True:
        system = "\n".join(lines)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": QUESTION.format(age=20 + i % 15, team=f"T{i}", goals=i % 9)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) >= length:
            return ids
        lines.append(f'- column {rng.choice(["Name", "Age", "Team", "Goals"])}_{len(lines)}: '
                     f'{{"type": "string", "description": "value {rng.randint(0, 999)} of the row"}}')


def _observation_tokens(tokenizer, length: int, rng: random.Random) -> list[int]:
    """A tool result of about `length` tokens, then the next assistant header."""
    rows = []
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < length:
        rows.append(f"('player_{rng.randint(0, 9999)}', {rng.randint(18, 40)}, 'T{rng.randint(0, 99)}')")
        text = "[" + ", ".join(rows) + "]"
    wrapped = f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(wrapped, add_special_tokens=False)


def run_setting(args: argparse.Namespace) -> dict:
    """One setting, in this process: build the engine, play the episodes, return the figures."""
    import torch

    from tiderl.lab.engine_memory import kv_bytes_per_token, kv_memory
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.rollout.base import SamplingParams
    from tiderl.rollout.torch_engine import TorchEngine

    torch.set_num_threads(args.threads)
    n = args.in_flight
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype="bfloat16")
    budget = {} if args.prefill_tokens < 0 else {"prefill_tokens": args.prefill_tokens}
    engine = TorchEngine(model, tokenizer, max_batch_size=n, **budget)
    prefill_s = [0.0]
    prefill = engine._prefill

    def timed_prefill(*a, **k):  # the time spent prefilling joining requests
        t = time.perf_counter()
        try:
            return prefill(*a, **k)
        finally:
            prefill_s[0] += time.perf_counter() - t

    engine._prefill = timed_prefill
    first_prefill_kb = [0]
    admit = engine._admit

    def first_admit() -> None:  # the peak until the first requests have joined (their prefill)
        admit()
        if engine._rows and not first_prefill_kb[0]:
            first_prefill_kb[0] = _status_kb("VmHWM")

    engine._admit = first_admit
    if args.strided_head:  # the engine before the fix: its output head takes the strided slice
        engine.model.get_output_embeddings()._forward_pre_hooks.clear()
    del model  # the engine holds its own copy; the caller's is not what is measured
    import gc

    gc.collect()
    weights_kb = _status_kb("VmRSS")
    _reset_peak()  # VmHWM from here on: the episodes' peak, not the loading's
    per_token = kv_bytes_per_token(engine.model)

    rng = random.Random(args.seed)
    episodes = []
    for i in range(n):
        turns = rng.randint(*args.turns)
        episodes.append({
            "prompt": _prompt_tokens(tokenizer, i, rng.randint(args.prompt - 100, args.prompt), rng),
            "turns": turns,
            "max_new": [rng.randint(args.new_tokens // 2, args.new_tokens * 3 // 2) for _ in range(turns)],
            "obs": [rng.randint(args.observation // 2, args.observation * 3 // 2) for _ in range(turns)],
            "done": 0,
        })
    for e in episodes:  # tokenized before the clock starts
        e["obs"] = [_observation_tokens(tokenizer, k, rng) for k in e["obs"]]

    peak = {"held": 0, "needed": 0, "batch": 0, "kept": 0, "rss_kb": 0}
    stop = threading.Event()
    over = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss = _status_kb("VmRSS")
            mem = kv_memory(engine)
            held = mem["batch_bytes"] + mem["kept_bytes"]
            for key, value in (("held", held), ("needed", mem["needed_bytes"]), ("batch", mem["batch_bytes"]),
                               ("kept", mem["kept_bytes"]), ("rss_kb", rss)):
                peak[key] = max(peak[key], value)
            if rss > args.rss_limit_gb * GB / 1024:
                over.set()
                for request in list(engine._inbox) + [row.request for row in engine._rows]:
                    request.cancelled = True
                with engine._inbox_lock:
                    engine._inbox.clear()
                return
            time.sleep(0.02)

    finished = threading.Event()
    remaining = [n]
    generated = [0]

    def submit(i: int) -> None:
        e = episodes[i]
        params = SamplingParams(max_new_tokens=e["max_new"][e["done"]], temperature=0.0)
        engine.submit(e["prompt"], params, session=i, on_done=lambda result, i=i: on_done(i, result))

    def on_done(i: int, result) -> None:
        if isinstance(result, BaseException):
            raise result
        e = episodes[i]
        generated[0] += len(result.token_ids)
        e["prompt"] = e["prompt"] + result.token_ids + e["obs"][e["done"]]
        e["done"] += 1
        if e["done"] < e["turns"]:
            submit(i)
        else:
            engine.end_session(i)
            remaining[0] -= 1
            if remaining[0] == 0:
                finished.set()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for i in range(n):
        submit(i)
    t0 = time.perf_counter()
    profile_rows = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _serve_in_thread(engine)
        table = prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=12,
                                          max_name_column_width=48)
        profile_rows = table
    else:
        _serve_in_thread(engine)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    return {
        "in_flight": n,
        "weights_gb": weights_kb * 1024 / GB,
        "peak_rss_gb": max(peak["rss_kb"], _status_kb("VmHWM")) * 1024 / GB,
        "held_kv_gb": peak["held"] / GB,
        "needed_kv_gb": peak["needed"] / GB,
        "batch_kv_gb": peak["batch"] / GB,
        "kept_kv_gb": peak["kept"] / GB,
        "kv_bytes_per_token": per_token,
        "episodes_finished": n - remaining[0],
        "generated_tokens": generated[0],
        "wall_s": wall,
        "prefill_s": prefill_s[0],
        "first_prefill_gb": (first_prefill_kb[0] - weights_kb) * 1024 / GB,
        "prefill_tokens": engine.prefill_tokens,
        "stopped_at_rss_limit": over.is_set(),
        "stats": engine.stats,
        "profile": profile_rows,
    }


def _rss_parts_kb() -> tuple[int, int, int]:
    """(VmRSS, RssAnon, RssFile) of this process in kB."""
    return _status_kb("VmRSS"), _status_kb("RssAnon"), _status_kb("RssFile")


def run_eval(args: argparse.Namespace) -> dict:
    """One `tiderl eval` in this process (`--eval`), as it is now or, with `args.eval_baseline`,
    as it was: the engine copies the policy and the heap is never trimmed."""
    import tiderl.evaluate
    import tiderl.rollout
    from tiderl.cli import main as tiderl_main
    from tiderl.lab.engine_memory import kv_memory
    from tiderl.rollout.torch_engine import TorchEngine

    built: dict = {}
    make_engine = tiderl.rollout.make_engine

    def counting_make_engine(cfg, model, tokenizer, seed, copy_model=True):
        engine = make_engine(cfg, model, tokenizer, seed, copy_model=copy_model or args.eval_baseline)
        built["engine"], built["rss_kb"] = engine, _status_kb("VmRSS")
        if args.eval_baseline:  # eval used to hold the loaded policy (its local) until it returned
            built["policy"] = model
        return engine

    tiderl.rollout.make_engine = counting_make_engine
    trims = {"calls": 0, "seconds": 0.0, "longest": 0.0}
    if args.eval_baseline:  # cmd_eval imports it when it runs, so this reaches it
        tiderl.evaluate.trimmed_heap = functools.partial(tiderl.evaluate.trimmed_heap, interval_s=0)
    else:  # time each trim: the decoding thread waits for the heap while one runs
        malloc_trim = tiderl.evaluate._malloc_trim()

        def timed_trim(pad: int) -> int:
            t = time.perf_counter()
            result = malloc_trim(pad)
            took = time.perf_counter() - t
            trims["calls"] += 1
            trims["seconds"] += took
            trims["longest"] = max(trims["longest"], took)
            return result

        if malloc_trim is not None:
            tiderl.evaluate._malloc_trim = lambda: timed_trim
    peak = {"rss": (0, 0, 0), "held": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            parts = _rss_parts_kb()
            if parts[0] > peak["rss"][0]:
                peak["rss"] = parts
            engine = built.get("engine")
            if isinstance(engine, TorchEngine):
                mem = kv_memory(engine)
                peak["held"] = max(peak["held"], mem["batch_bytes"] + mem["kept_bytes"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = Path(args.eval_out)
    n = args.eval_tasks
    t0 = time.perf_counter()
    code = tiderl_main(["eval", "--config", args.eval_config, f"model.path={args.model}", "model.dtype=bfloat16",
                        f"data.eval_size={n}", f"rollout.engine_batch_size={args.eval_in_flight}",
                        "eval.sampled=false", "log.progress=false", f"run_dir={out.parent / 'run'}",
                        "--json", str(out)])
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    result = json.loads(out.read_text())["greedy"] if code == 0 else {}
    rss, anon, file = peak["rss"]
    return {
        "exit": code, "baseline": args.eval_baseline, "wall_s": wall,
        "peak_rss_gb": max(rss, _status_kb("VmHWM")) * 1024 / GB,
        "peak_anon_gb": anon * 1024 / GB, "peak_file_gb": file * 1024 / GB,
        "engine_built_rss_gb": built.get("rss_kb", 0) * 1024 / GB, "held_kv_gb": peak["held"] / GB,
        "episodes": result.get("episodes"), "success": result.get("success"),
        "gen_tokens": result.get("action_tokens"), "trims": trims,
    }


def main_eval(args: argparse.Namespace) -> int:
    """`--eval`: the baseline evaluation, then the current one, each in a fresh process."""
    import tempfile

    from tiderl.config import load_config
    from tiderl.envs.setup import data_root

    root = data_root(load_config(args.eval_config, []).data.data_dir)
    if not (root / "metaqa" / "kb.txt").is_file():
        print(f"engine_memory --eval: skipped, no MetaQA data under {root} (set $TIDERL_DATA_DIR to the folder "
              "holding metaqa/)")
        return 0
    runs = {}
    for baseline in (True, False):
        with tempfile.TemporaryDirectory(prefix="tiderl-eval-memory-") as tmp:
            command = [sys.executable, __file__, "--model", args.model, "--eval-child",
                       "--eval-tasks", str(args.eval_tasks), "--eval-in-flight", str(args.eval_in_flight),
                       "--eval-config", args.eval_config, "--eval-out", str(Path(tmp) / "eval.json")]
            command += ["--eval-baseline"] if baseline else []
            out = subprocess.run(command, check=False, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        name = "baseline" if baseline else "now"
        if out.returncode != 0 or not lines:
            print(f"{name}: the process failed (exit {out.returncode}): {out.stderr[-2000:]}")
            return 1
        r = runs[name] = json.loads(lines[-1])
        print(f"{name:8s}: peak RSS {r['peak_rss_gb']:.2f} GB (at the peak: anonymous {r['peak_anon_gb']:.2f}, "
              f"file-backed {r['peak_file_gb']:.2f}), {r['engine_built_rss_gb']:.2f} GB once the engine was built, "
              f"KV held at most {r['held_kv_gb']:.2f} GB; success {r['success']:.3f} over {r['episodes']} episodes, "
              f"{r['gen_tokens']:.1f} generated tokens each, {r['wall_s']:.0f} s"
              + (f"; {r['trims']['calls']} heap trims took {r['trims']['seconds']:.2f} s in all (longest "
                 f"{r['trims']['longest'] * 1e3:.0f} ms)" if r["trims"]["calls"] else ""), flush=True)
    print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")
    b, r = runs["baseline"], runs["now"]
    # The fixes change no weight, so an engine gives the same tokens either way for the same batch
    # (tests/test_engine_ownership.py). Which rows share a decode step depends on timing, though,
    # and bf16 log-probs move by a few hundredths with the batch, so a greedy near-tie can go the
    # other way and the episodes' tokens differ slightly between two runs, of either kind.
    same = (b["success"], b["gen_tokens"]) == (r["success"], r["gen_tokens"])
    print(f"tiderl eval MetaQA, {args.eval_tasks} tasks, {args.eval_in_flight} in flight: peak RSS baseline "
          f"{b['peak_rss_gb']:.2f} GB, now {r['peak_rss_gb']:.2f} GB, ratio {b['peak_rss_gb'] / r['peak_rss_gb']:.2f}; "
          + ("results identical" if same else
             f"success {b['success']:.3f} / {r['success']:.3f}, generated tokens {b['gen_tokens']:.1f} / "
             f"{r['gen_tokens']:.1f} (greedy ties broken by batch timing)"))
    return 0


def _child(args: argparse.Namespace, n: int, *extra: str) -> dict | str:
    """Run one setting in a fresh process: its figures, or why it failed."""
    command = [sys.executable, __file__, "--model", args.model, "--child", str(n), "--threads", str(args.threads),
               "--rss-limit-gb", str(args.rss_limit_gb), "--seed", str(args.seed), "--prompt", str(args.prompt),
               *(["--quick"] if args.quick else []), *extra]
    out = subprocess.run(command, check=False, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return f"the process failed (exit {out.returncode}): {out.stderr[-2000:]}"
    return json.loads(lines[-1])


def main_prefill_budget(args: argparse.Namespace, settings: list[int]) -> int:
    """No prefill budget against `--prefill-tokens`, interleaved, each run in a fresh process."""
    summary = []
    for n in settings:
        runs: dict[str, list[dict]] = {"baseline": [], "budget": []}
        for _ in range(args.repeats):
            for name, tokens in (("baseline", 0), ("budget", args.prefill_tokens)):
                r = _child(args, n, "--prefill-tokens", str(tokens))
                if isinstance(r, str):
                    print(f"{name}, in flight {n}: {r}")
                    return 1
                runs[name].append(r)
                rate = r["stats"]["encoded_tokens"] / max(r["prefill_s"], 1e-9)
                print(f"{name:8s} (prefill_tokens {r['prefill_tokens']}), in flight {n}: weights {r['weights_gb']:.2f} GB, "
                      f"peak RSS {r['peak_rss_gb']:.2f} GB (+{r['peak_rss_gb'] - r['weights_gb']:.2f}; first prefill "
                      f"+{r['first_prefill_gb']:.2f}), KV held "
                      f"{r['held_kv_gb']:.3f} GB, prefill {r['prefill_s']:.1f} s for {r['stats']['encoded_tokens']} "
                      f"tokens ({rate:.0f} tokens/s, {r['stats']['prefill_passes']} passes), "
                      f"{r['generated_tokens']} tokens generated, {r['wall_s']:.0f} s, "
                      f"load {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)

        def figures(rs: list[dict]) -> tuple[float, float, float, float]:
            peak = max(r["peak_rss_gb"] for r in rs)
            growth = max(r["peak_rss_gb"] - r["weights_gb"] for r in rs)
            first = max(r["first_prefill_gb"] for r in rs)
            rate = sum(r["stats"]["encoded_tokens"] for r in rs) / max(sum(r["prefill_s"] for r in rs), 1e-9)
            return peak, growth, first, rate

        (bp, bg, bf, br), (cp, cg, cf, cr) = figures(runs["baseline"]), figures(runs["budget"])
        summary.append(f"{n} in flight, ~{args.prompt}-token prompts, no budget vs prefill_tokens "
                       f"{runs['budget'][0]['prefill_tokens']}: first prefill +{bf:.2f} vs +{cf:.2f} GB over the "
                       f"weights (ratio {bf / max(cf, 1e-9):.2f}); whole run peak RSS {bp:.2f} vs {cp:.2f} GB "
                       f"(+{bg:.2f} vs +{cg:.2f}, ratio {bg / max(cg, 1e-9):.2f}); prefill {br:.0f} vs {cr:.0f} "
                       f"tokens/s (ratio {cr / max(br, 1e-9):.2f})")
    print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")
    print("; ".join(summary))
    return 0


def _serve_in_thread(engine) -> None:
    """Decode on a thread of its own, as the batching client does (its executor thread)."""
    worker = threading.Thread(target=engine.serve)
    worker.start()
    worker.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("TIDERL_ENGINE_MEMORY_MODEL", str(DEFAULT_MODEL)))
    parser.add_argument("--in-flight", type=str, default="8,16,32", help="episodes in flight, comma-separated")
    parser.add_argument("--quick", action="store_true", help="3 turns of about 20 tokens")
    parser.add_argument("--baseline", action="store_true", help="also run each setting before the fix")
    parser.add_argument("--profile", type=int, default=0, help="also profile the setting with this many in flight")
    parser.add_argument("--rss-limit-gb", type=float, default=16.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval", action="store_true", help="measure a whole `tiderl eval` (MetaQA), before and now")
    parser.add_argument("--eval-config", default=str(Path(__file__).resolve().parents[1]
                                                     / "configs/qwen2.5-coder-0.5b_kg_sao.yaml"))
    parser.add_argument("--eval-tasks", type=int, default=0, help="held-out tasks (default 64, --quick 16)")
    parser.add_argument("--eval-in-flight", type=int, default=0, help="episodes in flight (default 32, --quick 16)")
    parser.add_argument("--eval-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eval-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eval-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strided-head", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-budget", action="store_true",
                        help="compare no prefill budget (baseline) with --prefill-tokens, interleaved")
    parser.add_argument("--prefill-tokens", type=int, default=-1,
                        help="the engine's prefill budget (-1: its default; 0: no limit)")
    parser.add_argument("--repeats", type=int, default=1, help="--prefill-budget: runs of each, interleaved")
    parser.add_argument("--prompt", type=int, default=650, help="prompt length in tokens (about)")
    args = parser.parse_args()
    args.observation = 100
    args.turns, args.new_tokens = ((3, 3), 20) if args.quick else ((3, 5), 60)

    if not (Path(args.model) / "config.json").exists():
        print(f"engine_memory: skipped, no model directory at {args.model} (fetch it with `tiderl models fetch "
              "qwen2.5-coder-0.5b-instruct`, or pass --model DIR)")
        return 0

    if args.eval or args.eval_child:
        args.eval_tasks = args.eval_tasks or (16 if args.quick else 64)
        args.eval_in_flight = args.eval_in_flight or (16 if args.quick else 32)
        if args.eval_child:
            print(json.dumps(run_eval(args)), flush=True)
            return 0
        return main_eval(args)
    if args.child:
        args.in_flight, args.profile = args.child, args.child_profile
        print(json.dumps(run_setting(args)), flush=True)
        return 0

    settings = [int(x) for x in args.in_flight.split(",")]
    if args.prefill_budget:
        return main_prefill_budget(args, settings)
    runs = [(n, False, False) for n in settings] + [(n, False, True) for n in settings if args.baseline]
    runs += [(args.profile, True, False)] if args.profile else []
    results, baseline = [], {}
    for n, with_profile, strided in runs:
        command = [sys.executable, __file__, "--model", args.model, "--child", str(n), "--threads", str(args.threads),
                   "--rss-limit-gb", str(args.rss_limit_gb), "--seed", str(args.seed)]
        command += ["--quick"] if args.quick else []
        command += ["--child-profile"] if with_profile else []
        command += ["--strided-head"] if strided else []
        out = subprocess.run(command, check=False, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            print(f"in flight {n}: the process failed (exit {out.returncode}): {out.stderr[-2000:]}")
            continue
        r = json.loads(lines[-1])
        if with_profile:
            print(f"--- torch.profiler, {n} in flight, ops by self CPU memory ---\n{r['profile']}")
            continue
        (baseline.__setitem__(n, r) if strided else results.append(r))
        print(f"{'baseline ' if strided else ''}in flight {n:3d}: weights {r['weights_gb']:.2f} GB, peak RSS {r['peak_rss_gb']:.2f} GB, "
              f"KV held at peak {r['held_kv_gb']:.3f} GB (batch {r['batch_kv_gb']:.3f}, kept {r['kept_kv_gb']:.3f}), "
              f"KV needed {r['needed_kv_gb']:.3f} GB, {r['episodes_finished']}/{n} episodes, "
              f"{r['generated_tokens']} tokens, {r['wall_s']:.0f} s"
              + (" STOPPED at the RSS limit" if r["stopped_at_rss_limit"] else ""), flush=True)
    print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")

    def before(r: dict) -> str:
        b = baseline.get(r["in_flight"])
        if b is None:
            return ""
        limit = " or more: stopped at the limit" if b["stopped_at_rss_limit"] else ""
        return f" (baseline {b['peak_rss_gb']:.2f} GB{limit}, ratio {b['peak_rss_gb'] / r['peak_rss_gb']:.2f})"

    print("; ".join(
        f"{r['in_flight']} in flight: peak RSS {r['peak_rss_gb']:.2f} GB{before(r)}, "
        f"+{r['peak_rss_gb'] - r['weights_gb']:.2f} GB over weights, KV held {r['held_kv_gb']:.2f} GB"
        + (" (stopped at limit)" if r["stopped_at_rss_limit"] else "")
        for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
