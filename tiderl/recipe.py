"""The RL recipe, top to bottom: build the run, let the scheduler train it, save what it learned.

There is one training path. The scheduler (`tiderl.system.scheduler`) keeps rollout slots busy
and trains each batch of ready trajectories as soon as the staleness bound allows;
`system.max_staleness=0` is synchronous on-policy training (every trained token was sampled by
the weights it trains), larger bounds let rollout run ahead. The backend (`system.backend`)
only decides where episodes run: `local` in this process, `ray` in Ray actors.

    run = build_run(cfg)              # tasks, model, engine, critic, reference (tiderl.run)
    history, summary = train(run)     # the scheduler, until train.steps
    save_run_checkpoint(run, ...)     # the full state: weights, optimizers, RNGs, the schedule

Checkpoints (`run_dir/checkpoints/step_N`, every `train.checkpoint_every` steps or
`train.checkpoint_every_s` seconds) hold everything a resume needs (docs/architecture.md,
"Checkpoints and resume"); `train.resume=auto` continues from the latest complete one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiderl.aio import InlineExecutor, cores
from tiderl.algos.sampling import has_signal
from tiderl.config import RunConfig, dump_yaml
from tiderl.evaluate import append_training_transcripts
from tiderl.metrics.logger import MetricsLogger
from tiderl.metrics.summary import rollout_metrics
from tiderl.registry import BACKENDS, resolve
from tiderl.rewards.curiosity import batch_metrics as curiosity_metrics
from tiderl.run import (Checkpoints, Run, Trainer, build_run, open_ledger, preparations_for, resume_schedule,
                        save_run_checkpoint, sync_weights)
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.cores import available_cores, pinned_thread, resolve_cores
from tiderl.system.scheduler import Scheduler, SchedulerSettings
from tiderl.types import Trajectory

Observer = Callable[[int, dict[str, float], list[Trajectory]], None]


def main(cfg: RunConfig) -> Path:
    """`tiderl train`: build (or resume), train up to `train.steps`, save the final checkpoint
    (unless `train.save_final` is off); returns the run dir's checkpoints folder or final."""
    run = build_run(cfg)
    train(run)
    final = Path(cfg.run_dir) / "checkpoints" / "final"
    if cfg.train.parallel != "none":  # saved by the ranks at the last step (run.Checkpoints)
        return final if cfg.train.save_final else final.parent
    return save_run_checkpoint(run, final) if cfg.train.save_final else final.parent


def train(run: Run, steps: int | None = None, observer: Observer | None = None,
          stop: Callable[[dict[str, float]], bool] | None = None) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Train from `run.step` up to `train.steps` (or `steps` more); returns (history, summary).

    `observer(version, metrics, batch)` sees every step (tests, benchmarks); `stop(metrics)` may
    end the run early (e.g. at a token budget). Metrics go to `run_dir/metrics.jsonl` (and
    TensorBoard), the run's totals (ledger, staleness histogram, slot changes, backend report)
    to `run_dir/system.json`. Afterwards `run.engine` holds the trained weights.
    """
    cfg = run.cfg
    steps = cfg.train.steps - run.step if steps is None else steps
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    settings, s = SchedulerSettings.from_config(cfg), cfg.system
    preparations = preparations_for(run)  # critic values / reference log-probs, ahead of the step
    # Synchronous training never decodes, prepares and trains at once: all three run in this
    # thread, one torch thread pool as in a plain loop. Asynchronous training overlaps them, each
    # on its own thread with its own budget (system.*_threads), on the cores system.cores gives it
    # (tiderl.system.cores; the backend resolves the same plan, before this thread is pinned).
    plan = resolve_cores(s.cores, available_cores(), synchronous=s.max_staleness == 0)
    compute = InlineExecutor(plan.threads_for("trainer", s.trainer_threads, 0)) if s.max_staleness == 0 else None
    rollout = resolve(BACKENDS, s.backend, "system.backend").from_run(run, preparations, executor=compute)
    if cfg.train.parallel == "none":
        trainer = Trainer(run, preparations)
    else:  # data-parallel ranks as Ray actors (docs/ray.md)
        from tiderl.system.ray_trainer import RayParallelTrainer

        trainer = RayParallelTrainer(run, preparations)
    run.trainer = trainer
    logger = MetricsLogger(run_dir, steps, cfg.log.tensorboard, cfg.log.progress)
    checkpoints = Checkpoints(run)
    if run.setup.on_step is not None:
        run.setup.on_step(run.step)

    def on_step(version: int, metrics: dict[str, float], batch: list[Trajectory]) -> None:
        metrics.update(rollout_metrics(batch))
        metrics.update(curiosity_metrics(batch))
        run.step = version
        if run.setup.on_step is not None:  # a drifting world moves with the step (env.drift)
            run.setup.on_step(version)
        logger.log(version, metrics)
        append_training_transcripts(run.tokenizer, batch, version, cfg.log.transcripts, run_dir / "transcripts")
        if observer is not None:
            observer(version, metrics, batch)
        checkpoints.after_step(version)  # between steps: the trainer thread is idle

    def informative(group: list[Trajectory]) -> bool:  # dynamic sampling: equal rewards teach nothing
        return has_signal([t.reward for t in group])

    async def schedule() -> tuple[list[dict[str, float]], dict[str, Any]]:
        # Environments without `astep` step on the default executor: a thread per slot, so slow
        # tools do not queue behind each other.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(settings.most_slots() + 4))
        # Reproducible runs prepare one trajectory at a time: a batch's padded shape would depend on
        # which trajectories happened to be waiting, and that changes float sums in the last bits.
        buffer = ReadyBuffer(preparations, group_size=settings.group_size,
                             max_prep_batch=1 if cfg.train.reproducible else 64,
                             thread_init=plan.thread_init("prep", plan.threads_for("prep", s.prep_threads, 0)),
                             accept_group=informative if cfg.algo.dynamic_sampling else None, executor=compute)
        ledger, lost = open_ledger(run)  # run_dir/ledger.jsonl, cut back to the checkpoint on resume
        scheduler = Scheduler(settings, lambda: run.tasks.take(1)[0], rollout, trainer, buffer, on_step=on_step,
                              start_version=run.step, shape=run.shape, trainer_executor=compute, ledger_log=ledger,
                              trainer_thread_init=plan.thread_init(
                                  "trainer", plan.threads_for("trainer", s.trainer_threads, max(1, cores() - cores() // 2))))
        resume_schedule(run, scheduler, lost)
        await rollout.start()
        try:
            history = await scheduler.run(steps, stop)
        finally:
            getattr(trainer, "close", lambda: None)()  # data-parallel ranks hand back their weights and stop
            run.trainer = None
            await rollout.close()
            ledger.close()
        return history, {**scheduler.summary(), "backend": rollout.report(),
                         "cores": {"plan": plan.describe(), "threads": plan.pinned_threads}}

    try:
        with pinned_thread(plan.rollout):  # the event loop: episode bookkeeping, tool calls, tokenizing
            history, summary = asyncio.run(schedule())
    finally:
        logger.close()
        if compute is not None:
            compute.shutdown(wait=True)
        for p in preparations:
            getattr(p, "close", lambda: None)()
    if run.engine.version != run.step:  # rollouts ran elsewhere (Ray): evaluation samples here
        sync_weights(run)
    (run_dir / "system.json").write_text(json.dumps(summary, indent=2))
    return history, summary


__all__ = ["Observer", "build_run", "main", "train"]
