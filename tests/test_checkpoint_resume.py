"""Full-state checkpoints: exact resume at staleness 0, a ledger for every task across a kill,
kill -9 of `tiderl train` at a random moment, and the errors that name the cause and the fix.

Runs train a tiny untrained model on the parity environment of `tests/user_env.py` (SAO: a
critic, its optimizer and the curiosity counts are in every checkpoint), a few steps each.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tiderl.cli import main
from tiderl.config import ConfigError, load_config
from tiderl.models.loading import load_model, save_model_dir
from tiderl.recipe import train
from tiderl.run import build_run
from tiderl.train.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints

from support import TIMED, parity_model_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parity_model(tmp_path_factory):
    return parity_model_dir(tmp_path_factory.mktemp("parity"))


def overrides(model, run_dir, *more):
    """A tiny SAO run on the parity environment (rewarded by answer length): 4 trajectories per
    step, one torch thread; synchronous and reproducible unless `more` says otherwise."""
    return ["env.name=resume_env:LengthReward", "data.source=parity", f"model.path={model}", f"run_dir={run_dir}",
            "algo.name=sao", "algo.critic_warmup_steps=1", "algo.actor_lr=1e-3", "algo.critic_lr=1e-3",
            "rollout.batch_size=4", "env.max_turns=2", "env.max_total_tokens=200", "rollout.max_new_tokens=24",
            "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false",
            "system.trainer_threads=1", "system.decode_threads=1",
            *(["train.reproducible=true"] if not any("max_staleness" in m for m in more) else []), *more]


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def exact(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMED)}


@pytest.mark.slow
def test_resume_from_step_k_equals_the_uninterrupted_run(parity_model, tmp_path):
    """max_staleness=0: resumed from step 2's checkpoint, steps 3-5 equal the uninterrupted
    run's bit for bit (every metric but wall-clock ones), and so do the final weights."""
    a = build_run(load_config(None, overrides(parity_model, tmp_path / "a", "train.steps=5",
                                              "train.checkpoint_every=2")))
    train(a)
    ckpt = tmp_path / "a" / "checkpoints" / "step_2"
    assert (ckpt / "curiosity.json").is_file() and (ckpt / "critic").is_dir()
    # The resumed run writes into a copy of the run dir, whose metrics and ledger run past step 2.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = build_run(load_config(None, overrides(parity_model, tmp_path / "b", "train.steps=5", "train.resume=auto",
                                              "train.checkpoint_every=2")))
    assert b.step == 4 and b.resumed_from.endswith("step_4")  # auto: the latest complete one
    b = build_run(load_config(None, overrides(parity_model, tmp_path / "b", "train.steps=5",
                                              f"train.resume={tmp_path / 'b' / 'checkpoints' / 'step_2'}")))
    assert [r["step"] for r in rows(tmp_path / "b")] == [1, 2]  # cut back to the resumed step
    train(b)
    ra, rb = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in rb] == [1, 2, 3, 4, 5]
    assert any(r.get("policy/loss") for r in ra[2:])  # the actor trained in the compared steps
    for x, y in zip(ra, rb):
        assert exact(x) == exact(y), f"step {x['step']} differs"
    for k, v in a.actor.model.state_dict().items():
        assert torch.equal(v, b.actor.model.state_dict()[k]), k
    for k, v in a.critic.model.state_dict().items():
        assert torch.equal(v, b.critic.model.state_dict()[k]), k
    assert a.curiosity.state_dict() == b.curiosity.state_dict()
    ledger = json.loads((tmp_path / "b" / "system.json").read_text())["ledger"]
    assert replay(read_events(tmp_path / "b" / "ledger.jsonl"))["trained"] == ledger["trained"] == 20


@pytest.mark.slow
def test_checkpoints_are_atomic_pruned_and_complete(parity_model, tmp_path):
    cfg = load_config(None, overrides(parity_model, tmp_path, "train.steps=4", "train.checkpoint_every=1",
                                      "train.keep_last=2"))
    assert main(["train", *overrides(parity_model, tmp_path, "train.steps=4", "train.checkpoint_every=1",
                                     "train.keep_last=2")]) == 0
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["final", "step_3", "step_4"]
    for p in root.iterdir():  # every file is inside before the marker (curiosity.json included)
        assert {"actor", "critic", "trainer_state.pt", "curiosity.json", "tiderl_checkpoint.json"} <= {
            q.name for q in p.iterdir()}
    state = torch.load(root / "final" / "trainer_state.pt", weights_only=False)
    assert {"tasks", "python_rng", "numpy_rng", "engine_rng", "scheduler"} <= set(state)
    assert state["scheduler"]["version"] == 4 and state["scheduler"]["ledger"]["trained"] == 16
    # A half-written one (the process died while saving) is skipped by auto and refused by name.
    half = root / "step_9"
    shutil.copytree(root / "step_4", half)
    (half / "tiderl_checkpoint.json").unlink()
    assert latest_checkpoint(root) == root / "step_4"
    stale = root / ".step_5.tmp-999999"  # a save whose process died
    shutil.copytree(half, stale)
    assert stale in prune_checkpoints(root, keep_last=0) and (root / "step_3").is_dir()
    run = build_run(cfg)
    with pytest.raises(FileNotFoundError, match="half-written.*train.resume=auto"):
        load_checkpoint(half, run.actor, run.critic)
    # A checkpoint without a critic, resumed by an algorithm with one, names algo.name.
    shutil.rmtree(root / "step_3" / "critic")
    with pytest.raises(ValueError, match="algo.name"):
        load_checkpoint(root / "step_3", run.actor, run.critic)
    # save_final=false: no final checkpoint; a time interval saves after every step that passes it.
    assert main(["train", *overrides(parity_model, tmp_path / "nf", "train.steps=2", "train.save_final=false",
                                     "train.checkpoint_every_s=0.001")]) == 0
    assert sorted(p.name for p in (tmp_path / "nf" / "checkpoints").iterdir()) == ["step_1", "step_2"]


# ------------------------------------------------------------------ kill -9


def _train_process(args, log):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.Popen([sys.executable, "-m", "tiderl.cli", "train", *args], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_after_first_checkpoint(args, run_dir, rng):
    """Start `tiderl train`, wait for its first complete checkpoint, SIGKILL its process group
    a random moment later; returns the delay."""
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = _train_process(args, log)
        while not list(run_dir.glob("checkpoints/step_*/tiderl_checkpoint.json")):
            # A run that ends (or crashes) before its first checkpoint fails here with its log.
            assert proc.poll() is None, (run_dir.parent / f"{run_dir.name}.log").read_text()
            time.sleep(0.02)
        delay = rng.uniform(0.0, 0.3)
        time.sleep(delay)
        assert proc.poll() is None, "the run finished before it could be killed: give it more steps"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return delay


# Where each ledger event puts an attempt (the buckets of the pool's `Ledger`).
SETTLED = ("trained", "dropped_stale", "failed", "retried", "restarted", "filtered", "requeued", "lost")


def read_events(path):
    """The events of a ledger file (tiderl/system/ledger.py); a torn last line (the process died
    mid-write) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def replay(events) -> Counter:
    """The ledger counts the events give: `started` and every settled bucket."""
    counts: Counter = Counter()
    for e in events:
        ev = e.get("ev")
        if ev == "resume":
            counts = Counter(e.get("counts", {}))
        elif ev == "lost":
            counts["started"] += 1
            counts["lost"] += 1
        elif ev == "started" or ev in SETTLED:
            counts[ev] += 1
    return counts


def _ledger_balances(run_dir):
    """system.json's ledger, checked: every attempt in exactly one bucket, the file agrees, and
    per task no more settled than started."""
    summary = json.loads((run_dir / "system.json").read_text())["ledger"]
    assert summary["started"] == sum(summary[b] for b in SETTLED) + summary["unsettled"], summary
    events = read_events(run_dir / "ledger.jsonl")
    counts = replay(events)
    assert {k: counts[k] for k in ("started", *SETTLED)} == {k: summary[k] for k in ("started", *SETTLED)}
    per_task: dict[str, int] = {}
    for e in events:
        if e["ev"] in ("started", "lost"):
            per_task[e["task"]] = per_task.get(e["task"], 0) + 1
        if e["ev"] in SETTLED:
            per_task[e["task"]] = per_task.get(e["task"], 0) - 1
    return summary, per_task


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_kill_9_then_resume_accounts_for_every_task(parity_model, tmp_path, staleness):
    steps, batch = 14, 4
    rng = random.Random(1000 + staleness)
    run_dir = tmp_path / "killed"
    args = overrides(parity_model, run_dir, f"train.steps={steps}", "train.checkpoint_every=2",
                     "train.resume=auto",
                     # Asynchronous: a tool call takes 0.4 s, longer than a step, so episodes are in flight at checkpoints.
                     *([f"system.max_staleness={staleness}", "env.tool_latency=fixed", "env.tool_latency_s=0.4"]
                       if staleness else []))
    t0 = time.monotonic()
    delay = _kill_after_first_checkpoint(args, run_dir, rng)
    t_kill = time.monotonic() - t0
    assert not (run_dir / "system.json").exists()  # killed: no summary, but a ledger file
    killed = read_events(run_dir / "ledger.jsonl")
    assert any(e["ev"] == "started" for e in killed)
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    with open(tmp_path / "resume.log", "w") as log:
        assert _train_process(args, log).wait(timeout=120) == 0, (tmp_path / "resume.log").read_text()
    t_resume = time.monotonic() - t0 - t_kill

    done = rows(run_dir)
    assert [r["step"] for r in done] == list(range(1, steps + 1))  # each step once
    summary, per_task = _ledger_balances(run_dir)
    assert summary["trained"] == steps * batch
    cut = list(run_dir.glob("ledger.cut_at_step_*.jsonl"))
    lost_expected = sum(e["ev"] == "started" for p in cut for e in read_events(p))
    assert summary["lost"] == lost_expected
    resume = next(e for e in read_events(run_dir / "ledger.jsonl") if e["ev"] == "resume")
    # What the checkpoint held in flight was queued again; what it held finished was trained.
    saved = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["scheduler"]
    assert summary["requeued"] == len(saved["inflight"])
    assert saved["ledger"]["started"] - sum(saved["ledger"][b] for b in ("trained", "dropped_stale", "failed",
                                                                          "retried", "restarted", "filtered")) \
        == len(saved["inflight"]) + len(saved["buffered"])
    assert all(n >= 0 for n in per_task.values()) and sum(per_task.values()) == summary["unsettled"]
    print(f"\nstaleness {staleness}: killed {delay:.2f} s after the first checkpoint ({t_kill:.1f} s), resumed "
          f"from {checkpoint.name} (step {resume['step']}: {len(saved['inflight'])} in flight, "
          f"{len(saved['buffered'])} buffered) to step {done[-1]['step']} ({t_resume:.1f} s); ledger {summary}")
    if staleness == 0:
        assert not saved["inflight"] and not saved["buffered"]  # nothing in flight between synchronous steps
        assert main(["train", *overrides(parity_model, tmp_path / "whole", f"train.steps={steps}",
                                         "train.save_final=false")]) == 0
        for x, y in zip(rows(tmp_path / "whole"), done, strict=True):
            assert exact(x) == exact(y), f"step {x['step']} differs from the uninterrupted run"


# ------------------------------------------------------------------ errors that name the cause


@pytest.mark.slow
def test_nan_reward_stops_the_step_naming_task_and_env(parity_model, tmp_path):
    cfg = load_config(None, overrides(parity_model, tmp_path, "env.name=resume_env:NaNReward", "train.steps=1"))
    with pytest.raises(FloatingPointError, match=r"env.name=resume_env:NaNReward.*non-finite reward.*task 'n\d+'"):
        train(build_run(cfg))
    skip = build_run(load_config(None, overrides(parity_model, tmp_path / "s", "env.name=resume_env:NaNReward",
                                                 "train.steps=1", "train.nonfinite=skip")))
    before = {k: v.clone() for k, v in skip.actor.model.state_dict().items()}
    history, _ = train(skip)
    assert history[0]["nonfinite/skipped_trajectories"] == 4
    assert all(torch.equal(v, skip.actor.model.state_dict()[k]) for k, v in before.items())


def test_nan_loss_or_gradient_stops_the_step_before_the_weights_change(parity_model, tmp_path):
    from tiderl.run import Trainer
    from tiderl.types import Trajectory

    run = build_run(load_config(None, overrides(parity_model, tmp_path, "algo.critic_warmup_steps=0")))
    ids = run.tokenizer("Is 3 even or odd? odd")["input_ids"]
    batch = [Trajectory(tokens=ids, loss_mask=[0] * 5 + [1] * (len(ids) - 5),
                        behavior_logprobs=[0.0] * 5 + [float("nan")] * (len(ids) - 5),
                        policy_version=[-1] * 5 + [0] * (len(ids) - 5), reward=1.0, task_id=f"n{i}",
                        group_id=f"n{i}#0") for i in range(2)]
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"env.name=resume_env:LengthReward.*actor (loss|gradient).*n0, n1"):
        Trainer(run, []).train(batch)
    assert all(torch.equal(v, run.actor.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.timeout(120)  # a run that retried without end would hang here; this one ends in about a second
def test_env_whose_reset_always_fails_ends_the_run_fast_naming_it(parity_model, tmp_path):
    cfg = load_config(None, overrides(parity_model, tmp_path, "env.name=resume_env:ResetFails", "train.steps=1",
                                      "system.max_task_retries=1"))
    with pytest.raises(RuntimeError, match=r"env.name=resume_env:ResetFails keeps failing.*refused the connection"):
        train(build_run(cfg))


@pytest.mark.timeout(120)  # as above
def test_env_that_fails_once_running_ends_the_run_fast_naming_it(parity_model, tmp_path):
    from resume_env import ResetFailsAfterStartUp

    ResetFailsAfterStartUp.resets = 0
    cfg = load_config(None, overrides(parity_model, tmp_path, "env.name=resume_env:ResetFailsAfterStartUp",
                                      "train.steps=1", "system.max_task_retries=1"))
    run = build_run(cfg)  # the start-up check's resets succeed
    with pytest.raises(RuntimeError, match=r"keeps failing.*refused the connection"):
        train(run)


def test_bad_model_files_and_devices_are_named(parity_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(parity_model, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{broken}.*corrupt"):
        load_model(broken)
    # The same for a critic's files (a checkpoint's critic/ or algo.value_init).
    from tiderl.train.critic import ValueModel

    critic_dir = tmp_path / "critic"
    ValueModel.from_policy(load_model(parity_model)).save(critic_dir)
    head = critic_dir / "value_head.safetensors"
    head.write_bytes(head.read_bytes()[:50])
    with pytest.raises(ValueError, match=f"{critic_dir}.*corrupt"):
        ValueModel.load(critic_dir)
    nan = tmp_path / "nan"
    model = load_model(parity_model)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    from tiderl.models.loading import load_tokenizer

    save_model_dir(model, load_tokenizer(parity_model), nan)
    with pytest.raises(ValueError, match="non-finite"):
        load_model(nan)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="model.device=cuda.*Fix: model.device=cpu"):
            build_run(load_config(None, overrides(parity_model, tmp_path / "c", "model.device=cuda")))


@pytest.mark.slow  # two fresh Python processes that import transformers (about 8 s on 2 cores)
def test_models_load_without_hugging_face_hub_kernels(parity_model):
    """transformers 5 loads a model with hub kernels on; on a GPU `model.train()` then downloads
    kernels mid-run (and fails offline). Importing tiderl turns them off unless the user set
    USE_HUB_KERNELS (a fresh process, since this one imported tiderl long ago)."""
    code = ("import os, sys; from transformers import AutoModelForCausalLM\n"
            "before = AutoModelForCausalLM.from_pretrained(sys.argv[1]).use_kernels\n"
            "import tiderl; from tiderl.models.loading import load_model\n"
            "print(before, load_model(sys.argv[1]).use_kernels, os.environ['USE_HUB_KERNELS'])")
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    out = subprocess.run([sys.executable, "-c", code, str(parity_model)], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    # out[0]: transformers' own default (True in 5.x with `kernels` installed); tiderl's is off.
    assert out[1:] == ["False", "0"], out
    chosen = subprocess.run([sys.executable, "-c", "import os, tiderl; print(os.environ['USE_HUB_KERNELS'])"],
                            env={**env, "USE_HUB_KERNELS": "1"}, capture_output=True, text=True, check=True)
    assert chosen.stdout.strip() == "1"  # a user's own setting stays


def test_config_and_command_line_errors(parity_model, tmp_path, capsys):
    with pytest.raises(ConfigError, match="train.checkpoint_every"):
        load_config(None, ["train.checkpoint_every=-1"])
    # Overrides after a flag are overrides, not "unrecognized arguments".
    assert main(["train", "--dry-run", "train.steps=3", "--run-dir", str(tmp_path / "x"), "rollout.batch_size=2",
                 "algo.group_size=1"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and "batch_size: 2" in out and str(tmp_path / "x") in out
    # A run dir that cannot be written fails before any work.
    blocked = tmp_path / "ro"
    blocked.write_text("a file, not a directory")
    with pytest.raises(PermissionError, match="run_dir=.*cannot be written"):
        build_run(load_config(None, overrides(parity_model, blocked / "run")))
