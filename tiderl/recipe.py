"""The RL recipe: build the run, then one loop, the same for synchronous and asynchronous training.

    run = build_run(cfg)                     # tasks, model, engine, critic, reference (tiderl.run)
    history, summary = train(run)            # the loop below, until train.steps
    save_run_checkpoint(run, ...)            # the full state: weights, optimizers, RNGs, the pool

The loop takes a batch from the rollout pool (`tiderl.system.pool`), takes one optimizer step on
it, and publishes the new weights to the pool. The pool keeps episodes running on its backend
(`system.backend`: `local` in this process, `ray` in Ray actors, `agent` for an external agent
behind `tiderl serve`) and decides where the loop waits: at `system.max_staleness=0`
(synchronous, on-policy) `next_batch` waits until every trajectory of the batch was sampled by the
weights the step trains; larger bounds let rollout run ahead by that many versions.

Checkpoints (`run_dir/checkpoints/step_N`, every `train.checkpoint_every` steps or `train.checkpoint_every_s`
seconds) hold all a resume needs (docs/architecture.md); `train.resume=auto` continues from the latest one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiderl.config import RunConfig, dump_yaml
from tiderl.evaluate import append_training_transcripts
from tiderl.metrics.logger import MetricsLogger
from tiderl.metrics.summary import rollout_metrics
from tiderl.registry import BACKENDS, resolve
from tiderl.rewards.curiosity import batch_metrics as curiosity_metrics
from tiderl.run import (Checkpoints, HeldOut, Run, Trainer, TrainerThread, build_run, open_pool, preparations_for,
                        save_run_checkpoint, sync_weights)
from tiderl.system.cores import RunThreads, pinned_thread
from tiderl.types import Trajectory

# after_step(version, metrics, batch) -> True to stop the run early.
AfterStep = Callable[[int, dict[str, float], list[Trajectory]], bool]
Observer = Callable[[int, dict[str, float], list[Trajectory]], None]


async def loop(pool: Any, trainer: Any, steps: int, after_step: AfterStep) -> list[dict[str, float]]:
    """The training loop: `steps` optimizer steps (fewer if `after_step` says stop); returns each
    step's metrics. The pool runs episodes all along, the trainer steps in between."""
    await pool.start()
    history = []
    try:
        for _ in range(steps):
            batch = await pool.next_batch()                           # fresh within the staleness bound
            metrics = await trainer.step(batch)                       # one optimizer step of the algorithm
            await pool.publish(trainer.version, trainer.weights())    # rollout samples with them from now on
            metrics.update(pool.step_metrics(batch, metrics))         # time, ledger, throughput
            history.append(metrics)
            if after_step(trainer.version, metrics, batch):           # log, checkpoint, maybe stop
                break
    finally:
        trainer.close()  # data-parallel ranks hand back their weights and stop
        await pool.close()  # what is still in flight is cancelled and counted as unsettled
    return history


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
          stop: Callable[[dict[str, float]], bool] | None = None,
          backend: Any = None) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Train from `run.step` up to `train.steps` (or `steps` more); returns (history, summary).

    `observer(version, metrics, batch)` sees every step (tests, benchmarks); `stop(metrics)` may
    end the run early (e.g. at a token budget); `backend` replaces the one `system.backend` names
    (an object with the `RolloutBackend` methods). Metrics go to `run_dir/metrics.jsonl` (and
    TensorBoard), the run's totals (ledger, staleness histogram, capacity changes, the backend's
    report) to `run_dir/system.json`. Afterwards `run.engine` holds the trained weights.
    """
    cfg = run.cfg
    steps = cfg.train.steps - run.step if steps is None else steps
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    threads = RunThreads.from_config(cfg.system)  # one compute thread when synchronous, else one each
    preparations = preparations_for(run)  # critic values / reference log-probs, ahead of the step
    if backend is None:
        backend = resolve(BACKENDS, cfg.system.backend, "system.backend").from_run(run, preparations, threads.compute)
    pool = open_pool(run, backend, preparations, threads)
    run.trainer = learner = _learner(run, preparations)  # data-parallel ranks write their checkpoint shards
    trainer = TrainerThread(run, learner, threads.trainer)
    logger = MetricsLogger(run_dir, steps, cfg.log.tensorboard, cfg.log.progress, cfg.log.trackers, cfg)
    after_step = _after_step(run, logger, held_out := HeldOut(run), Checkpoints(run), observer, stop)
    if run.setup.on_step is not None:  # a drifting world starts at the run's step (env.options.drift)
        run.setup.on_step(run.step)
    try:
        held_out.before_training(logger)  # eval.before: the starting weights' figure, as step 0
        with pinned_thread(threads.plan.rollout):  # the event loop: episode bookkeeping, tool calls
            history = asyncio.run(loop(pool, trainer, steps, after_step))
    finally:
        run.trainer = None
        logger.close()
        threads.shutdown()
        for p in preparations:
            getattr(p, "close", lambda: None)()
    if run.engine.version != run.step:  # rollouts ran elsewhere (Ray): evaluation samples here
        sync_weights(run)
    summary = {**pool.summary(), "cores": {"plan": threads.plan.describe(), "threads": threads.plan.pinned_threads}}
    (run_dir / "system.json").write_text(json.dumps(summary, indent=2))
    return history, summary


def _learner(run: Run, preparations: list[Any]) -> Any:
    """The trainer `train.parallel` asks for: this process (`Trainer`), or data-parallel ranks as
    Ray actors (`RayParallelTrainer`, docs/ray.md)."""
    if run.cfg.train.parallel == "none":
        return Trainer(run, preparations)
    from tiderl.system.ray_trainer import RayParallelTrainer

    return RayParallelTrainer(run, preparations)


def _after_step(run: Run, logger: MetricsLogger, held_out: HeldOut, checkpoints: Checkpoints,
                observer: Observer | None, stop: Callable[[dict[str, float]], bool] | None) -> AfterStep:
    """What follows every step: the world's clock, held-out evaluation and checkpoints when due (the
    trainer is idle between steps), metrics, transcripts, the observer, and whether to stop early."""
    cfg, run_dir = run.cfg, Path(run.cfg.run_dir)

    def after_step(version: int, metrics: dict[str, float], batch: list[Trajectory]) -> bool:
        metrics.update(rollout_metrics(batch))
        metrics.update(curiosity_metrics(batch))
        if run.setup.on_step is not None:  # a drifting world moves with the step (env.options.drift)
            run.setup.on_step(version)
        metrics.update(held_out(version))  # eval.every: held-out success of the weights just published
        logger.log(version, metrics)
        append_training_transcripts(run.tokenizer, batch, version, cfg.log.transcripts, run_dir / "transcripts")
        if observer is not None:
            observer(version, metrics, batch)
        checkpoints.after_step(version, metrics)  # train.keep_best reads eval/success
        return stop is not None and stop(metrics)

    return after_step


__all__ = ["Observer", "build_run", "loop", "main", "train"]
