"""The data-parallel trainer on Ray (docs/ray.md, "The data-parallel trainer"): `TrainerRank` actors
run `tiderl.train.parallel.ParallelLearner`s over the one `train_step`; `RayParallelTrainer` is the
driver's side, the recipe's trainer.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tiderl.config import RunConfig
from tiderl.rollout.weights import weights_checksum
from tiderl.system.ray_backend import PublishedWeights, connect, cpu_module, kill_actor
from tiderl.train.checkpoint import load_sharded, save_sharded
from tiderl.train.forward import logprob_temperature
from tiderl.train.lora import is_lora, policy_state
from tiderl.train.parallel import ParallelLearner, full_state_dict, init_rank, published_state, unwrapped
from tiderl.train.memory import enable_activation_checkpointing
from tiderl.train.precision import trainer_autocast
from tiderl.train.step import train_step
from tiderl.types import Trajectory

logger = logging.getLogger(__name__)


@dataclass
class RankBundle:
    """What every rank is built from (put in the object store once): the config and the driver's
    freshly built models on the CPU (the same weights on every rank)."""

    cfg: RunConfig
    actor: torch.nn.Module
    critic: torch.nn.Module | None
    ref: torch.nn.Module | None
    pad_id: int
    image_processor: Any = None  # a vision-language model's, for batches with images


class TrainerRank:
    """One rank of the data-parallel trainer (a Ray actor): its `ParallelLearner`s for the actor
    and the critic, a replicated frozen reference, and `train_step`."""

    def __init__(self, rank: int, world_size: int, bundle: RankBundle, threads: int = 1):
        torch.set_num_threads(max(1, threads))
        self.rank, self.world_size, self.bundle = rank, world_size, bundle
        # Ray gives each GPU rank one visible device: cuda:0 inside the actor.
        self.device = "cuda:0" if bundle.cfg.model.device.startswith("cuda") else "cpu"
        self.actor: ParallelLearner | None = None
        self.critic: ParallelLearner | None = None

    def endpoint(self) -> str:
        """A TCP address on this rank's node for the process group's rendezvous (rank 0's)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str) -> dict[str, Any]:
        """Join the process group and build the learners (all ranks call it together)."""
        cfg, t = self.bundle.cfg, self.bundle.cfg.train
        init_rank(self.rank, self.world_size, init_method, self.device, timeout_s=cfg.system.wait_timeout_s)
        opts = dict(device=self.device, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
                    grad_clip=t.grad_clip)
        if t.activation_checkpointing:  # idempotent: the driver's models had it, this rank's copies get it too
            for model in filter(None, (self.bundle.actor, self.bundle.critic)):
                enable_activation_checkpointing(model)
        self.actor = ParallelLearner(self.bundle.actor, t.parallel, cfg.algo.actor_lr, **opts)
        if self.bundle.critic is not None:
            self.critic = ParallelLearner(self.bundle.critic, t.parallel, cfg.algo.critic_lr, **opts)
        self.ref = self.bundle.ref.to(self.device).eval() if self.bundle.ref is not None else None
        # the learners own the models now
        self.bundle = RankBundle(cfg, None, None, None, self.bundle.pad_id, self.bundle.image_processor)
        return {"rank": self.rank, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "device": self.device}

    def step(self, batch: list[Trajectory], version: int) -> dict[str, float]:
        """This rank's part of one `train_step` on the whole batch (every rank returns the
        batch's metrics)."""
        assert self.actor is not None, "TrainerRank.join() was not called"
        cfg = self.bundle.cfg
        with trainer_autocast(cfg.train.autocast, self.device):
            return train_step(batch, self.actor, self.critic, self.ref, cfg.algo, pad_id=self.bundle.pad_id,
                              micro_batch_tokens=cfg.train.micro_batch_tokens,
                              train_actor=version >= cfg.algo.critic_warmup_steps, device=self.device,
                              skip_zero_advantage=cfg.train.skip_zero_advantage,
                              temperature=logprob_temperature(cfg.rollout.temperature),
                              image_processor=self.bundle.image_processor)

    def publish(self, version: int) -> tuple[list[Any] | None, float | None]:
        """Gather what the engines load (`published_state`, a collective: the full policy
        weights, or a LoRA policy's adapters alone); rank 0 puts them in the object store and
        returns ([reference], checksum), the others (None, None). The reference is wrapped in a
        list so that Ray hands it over instead of resolving it."""
        assert self.actor is not None
        state = published_state(self.actor.model, self.actor.mode)
        if self.rank != 0:
            return None, None
        return [ray.put(state)], weights_checksum(state)

    def critic_state(self) -> dict[str, torch.Tensor] | None:
        """The full critic weights (a collective) on rank 0; None elsewhere."""
        assert self.critic is not None
        state = full_state_dict(self.critic.model, self.critic.mode)
        return state if self.rank == 0 else None

    def save_sharded(self, path: str) -> None:
        """Write this rank's shards of the weights and optimizer states to `path` (a collective)."""
        assert self.actor is not None
        save_sharded(path, self.actor, self.critic)

    def load_sharded(self, path: str) -> int:
        """Load a sharded checkpoint into this rank's learners (a collective); returns how many
        parameters have optimizer state now."""
        assert self.actor is not None
        load_sharded(path, self.actor, self.critic)
        return sum(len(learner.optimizer.state) for learner in (self.actor, self.critic) if learner is not None)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RayParallelTrainer:
    """The recipe's trainer for `train.parallel=ddp|fsdp2`: `train.world_size` `TrainerRank`
    actors, started (in a placement group) at the first step, so that the rollout workers of the
    Ray backend are placed first."""

    def __init__(self, run: Any, preparations: list[Any]):
        cfg: RunConfig = run.cfg
        self.run, self.cfg = run, cfg
        self.world_size = cfg.train.world_size
        self.timeout_s = cfg.system.wait_timeout_s
        self.refreshers = [p for p in preparations if hasattr(p, "refresh")]
        # The driver needs the trained critic every step when it computes critic values itself.
        self.pull_critic = run.critic is not None and (bool(self.refreshers) or
                                                       getattr(cfg.system.options, "remote_critic", False))
        # With system.backend=local the ranks run on a Ray this trainer starts (and stops), and the
        # engine in this process loads the weights from the driver's mirror.
        self.on_ray = cfg.system.backend == "ray"
        self.connected_here = False
        self.ranks: list[Any] = []
        self.pg: Any = None
        self.published: PublishedWeights | None = None
        self.mirrored_version = run.step
        self.info: list[dict[str, Any]] = []
        # A resumed run's sharded checkpoint: the ranks load it once, when they start.
        self.resume_shards: str | None = (getattr(run, "resume_state", None) or {}).pop("sharded", None)

    def _get(self, refs: Any, what: str) -> Any:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"trainer ranks: {what} took longer than system.wait_timeout_s="
                               f"{self.timeout_s:g}s") from None

    def start(self) -> None:
        """Place the ranks (one bundle each: 1 CPU, and 1 GPU with model.device=cuda), start them
        and form their process group."""
        if self.ranks:
            return
        self.connected_here = connect(getattr(self.cfg.system.options, "address", ""))
        gpu = self.cfg.model.device.startswith("cuda")
        bundle = {"CPU": 1, **({"GPU": 1} if gpu else {}), **self.cfg.train.rank_resources}
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)],
                                  strategy=self.cfg.train.placement.upper())
        self._get(self.pg.ready(), f"placing {self.world_size} ranks ({bundle} each; the cluster has "
                                   f"{ray.cluster_resources()})")
        run = self.run
        models = RankBundle(self.cfg, cpu_module(run.actor.model),
                            cpu_module(run.critic.model) if run.critic else None,
                            cpu_module(run.ref) if run.ref is not None else None, run.tokenizer.pad_token_id,
                            getattr(run.tokenizer, "image_processor", None))
        bundle_ref = ray.put(models)
        cls = ray.remote(TrainerRank)
        self.ranks = [cls.options(num_cpus=1, num_gpus=1 if gpu else 0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)
                                  ).remote(r, self.world_size, bundle_ref, self.cfg.system.trainer_threads or 1)
                      for r in range(self.world_size)]
        init_method = self._get(self.ranks[0].endpoint.remote(), "the rendezvous address")
        self.info = self._get([r.join.remote(init_method) for r in self.ranks], "joining the process group")
        if self.resume_shards:
            t0 = time.monotonic()
            entries = self._get([r.load_sharded.remote(self.resume_shards) for r in self.ranks],
                                f"loading the sharded checkpoint {self.resume_shards}")
            logger.info("trainer ranks loaded the sharded checkpoint %s in %.2fs (optimizer entries per rank: %s)",
                        self.resume_shards, time.monotonic() - t0, entries)
            self.resume_shards = None
        logger.info("%d trainer ranks (%s) ready: %s", self.world_size, self.cfg.train.parallel, self.info)

    def train(self, batch: list[Trajectory]) -> dict[str, float]:
        """One data-parallel optimizer step, then rank 0 publishes the new weights (blocking)."""
        version = self.run.step
        self.start()
        batch_ref = ray.put(batch)
        metrics = self._get([r.step.remote(batch_ref, version) for r in self.ranks], "a training step")[0]
        t0 = time.monotonic()
        published = self._get([r.publish.remote(version + 1) for r in self.ranks], "gathering the weights")[0]
        self.published = PublishedWeights(published[0][0], published[1], version + 1)
        metrics["time/publish_s"] = time.monotonic() - t0  # part of time/train_s
        if self.pull_critic:
            self._pull_critic()
            for p in self.refreshers:
                p.refresh(self.run.critic.model)
        every = self.cfg.train.checkpoint_every
        if version + 1 >= self.cfg.train.steps or (every > 0 and (version + 1) % every == 0):
            self.pull_actor()
        return metrics

    def save_sharded(self, path: Any) -> dict[str, Any]:
        """Every rank writes its shards of the weights and optimizer states to `path` (DCP; on
        several nodes `path` must be on a file system they share). Returns what the checkpoint's
        marker records."""
        self.start()
        self._get([r.save_sharded.remote(str(path)) for r in self.ranks], f"saving the sharded checkpoint {path}")
        return {"parallel": self.cfg.train.parallel, "world_size": self.world_size}

    def weights(self) -> PublishedWeights | dict[str, torch.Tensor]:
        """Rank 0's latest weights, by reference, with their checksum; for an engine in this
        process (system.backend=local), the driver's mirror brought up to them."""
        if self.published is None:
            raise RuntimeError("RayParallelTrainer.weights() before the first step")
        if not self.on_ray:
            self.pull_actor()
            return policy_state(self.run.actor.model)
        return self.published

    def _pull_critic(self) -> None:
        state = self._get([r.critic_state.remote() for r in self.ranks], "gathering the critic")[0]
        unwrapped(self.run.critic.model).load_state_dict(state)

    def pull_actor(self) -> None:
        """Load the latest published weights into the driver's actor (for evaluation, checkpoints)."""
        if self.published is None or self.mirrored_version == self.published.version:
            return
        state = self._get(self.published.ref, "fetching the published weights")
        # A LoRA policy's ranks publish the adapters alone: the frozen base is the driver's already.
        self.run.actor.model.load_state_dict(state, strict=not is_lora(self.run.actor.model))
        self.mirrored_version = self.published.version

    def close(self) -> None:
        """Bring the driver's actor and critic up to date, then stop the ranks."""
        if not self.ranks:
            return
        try:
            if ray.is_initialized():
                self.pull_actor()
                if self.run.critic is not None and not self.pull_critic and self.published is not None:
                    self._pull_critic()
                self._get([r.close.remote() for r in self.ranks], "closing")
        finally:
            for r in self.ranks:
                kill_actor(r)
            if self.pg is not None and ray.is_initialized():
                remove_placement_group(self.pg)
            self.ranks, self.pg = [], None
            if self.connected_here and ray.is_initialized():
                ray.shutdown()
