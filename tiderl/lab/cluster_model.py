"""From a run config to the simulator's settings: `tiderl simulate --config RUN.yaml --gpu h100`.

A cluster recipe (e.g. `configs/cluster_qwen7b_sao.yaml`) says what runs where: how many trainer
ranks (`train.world_size`, one GPU each), how many inference servers (`rollout.options.urls`, or
`launch`), the batch, the steps, the staleness and its stale policy, the tool latency. This module
turns that, a model size and a GPU's public peak figures into the discrete-event model's `Cluster`
and `Schedule` (tiderl/lab/simulate.py), with every assumption a named, overridable number:

- decode is memory-bound: one step reads the weights once (2 bytes per parameter in bf16) at
  `DECODE_BW_EFFICIENCY` of the GPU's HBM bandwidth, split over the server's tensor-parallel GPUs;
  each sequence in the batch adds the read of its KV cache (half the context budget,
  `env.max_total_tokens` / 2, on average) and its 2·P FLOPs at `DECODE_FLOP_EFFICIENCY` of peak;
- training is compute-bound: `train_flops_per_token` FLOPs per trained token (6·P for the policy's
  forward and backward, 6·P per critic update and 2·P for the critic's value pass where the
  algorithm has a critic, 2·P for a reference model), over every sampled token times
  `tokens_per_sampled` (prompt and observations are trained on too), at `mfu` of the ranks' peak;
- a weight sync writes and reads the bf16 weights once through `sync_gb_per_s` (files on shared
  storage plus a reload by default; a collective group would be faster);
- what episodes look like (turns, tokens per turn) is not in a run config: it comes from the
  scenario (`--scenario`, default agentic-cluster), and each simulate flag still overrides.

These are planning figures: they have not been checked against a GPU run (docs/simulate.md says
which figures exist and what they do not show).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiderl.lab.simulate import Cluster, Dist, Schedule, Workload

# Dense bf16 peak FLOP/s and HBM bytes/s from the vendors' data sheets (SXM parts).
GPUS = {"a100": (312e12, 2.0e12), "h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12)}
DECODE_BW_EFFICIENCY = 0.6  # share of HBM bandwidth a decode step's weight and KV reads reach
DECODE_FLOP_EFFICIENCY = 0.3  # share of peak the per-sequence matmuls of a decode step reach
OPTIMIZER_STEP_S = 5.0  # fixed part of a step: the optimizer, gathering sharded state, logging


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder: parameters and KV-cache bytes per token (bf16)."""

    params: float
    kv_bytes_per_token: float

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelShape":
        """From a Hugging Face `config.json` of a Llama/Qwen-style decoder."""
        h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or h // heads
        inter = cfg.get("intermediate_size", 4 * h)
        attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
        embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
        params = embeddings + layers * (attention + 3 * h * inter + 2 * h)
        return cls(params=float(params), kv_bytes_per_token=float(2 * layers * kv_heads * head_dim * 2))

    @classmethod
    def from_params(cls, params: float) -> "ModelShape":
        """Only the size known: the KV cache of a Qwen2.5-like decoder of that size (GQA with 4 KV
        heads of 128 over about 28 layers per 7B, scaled with the square root of the size)."""
        layers = 28 * (params / 7.6e9) ** 0.5
        return cls(params=params, kv_bytes_per_token=2 * layers * 4 * 128 * 2)


def model_shape(run_cfg: Any, params: float | None) -> ModelShape:
    """`params` when given, else the `config.json` in `model.path` (a local folder), else an error
    naming both ways."""
    if params:
        return ModelShape.from_params(params)
    path = Path(str(run_cfg.model.path)).expanduser() / "config.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return ModelShape.from_hf_config(data.get("text_config", data))
    raise ValueError(f"the model's size: {run_cfg.model.path!r} has no config.json here. Fix: give --params, "
                     "e.g. --params 7.6e9")


def train_flops_per_token(run_cfg: Any, params: float) -> float:
    """FLOPs the trainer spends per trained token: the policy's forward and backward (6·P), with a
    critic its updates (6·P each) and its value pass (2·P), with a reference model its pass (2·P)."""
    from tiderl.algos.registry import needs_critic

    algo = run_cfg.algo
    flops = 6 * params
    if needs_critic(algo):
        flops += (6 * algo.critic_updates + 2) * params
    if algo.kl_coef:
        flops += 2 * params
    return flops


def inference_servers(run_cfg: Any) -> int:
    """Servers the run's HTTP engine uses (launched, or given by URL); the torch engine counts one."""
    if run_cfg.rollout.engine != "http":
        return 1
    opts = run_cfg.rollout.options
    return opts.launch or len(opts.urls)


def cluster_from_config(run_cfg: Any, gpu: str, shape: ModelShape, *, mfu: float = 0.35,
                        tokens_per_sampled: float = 3.0, sync_gb_per_s: float = 2.0,
                        gpus_per_server: int = 1, engine_max_seqs: int = 256) -> Cluster:
    """The simulator's `Cluster` for `run_cfg` on `gpu` (a key of GPUS), by the rules above."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: use one of {', '.join(GPUS)}, e.g. --gpu h100")
    peak, bandwidth = GPUS[gpu]
    p = shape.params
    weights = 2 * p  # bf16 bytes
    context = run_cfg.env.max_total_tokens / 2
    ranks = run_cfg.train.world_size if run_cfg.train.parallel != "none" else 1
    return Cluster(
        engines=inference_servers(run_cfg), engine_max_seqs=engine_max_seqs,
        decode_step_s=weights / (gpus_per_server * bandwidth * DECODE_BW_EFFICIENCY),
        decode_step_per_seq_s=(context * shape.kv_bytes_per_token / (bandwidth * DECODE_BW_EFFICIENCY)
                               + 2 * p / (peak * DECODE_FLOP_EFFICIENCY)) / gpus_per_server,
        train_step_s=OPTIMIZER_STEP_S,
        train_s_per_token=train_flops_per_token(run_cfg, p) * tokens_per_sampled / (ranks * peak * mfu),
        sync_s=2 * weights / (sync_gb_per_s * 1e9))


def schedule_from_config(run_cfg: Any, schedule: Schedule) -> Schedule:
    """`schedule` with the run's batch, steps and admission (the stale policy is the compared async
    mode's: `stale_policy_of`)."""
    return replace(schedule, batch_size=run_cfg.rollout.batch_size, steps=run_cfg.train.steps,
                   admission=run_cfg.system.admission)


def workload_from_config(run_cfg: Any, workload: Workload) -> Workload:
    """`workload` (the scenario's episode shapes) with the run's simulated tool latency, if any."""
    e = run_cfg.env
    if e.tool_latency == "none":
        return workload
    cap = e.tool_latency_max_s or float("inf")
    kind = {"fixed": "const"}.get(e.tool_latency, e.tool_latency)
    spread = 0.0 if kind == "const" else e.tool_latency_spread
    return replace(workload, tool_latency_s=Dist(kind, e.tool_latency_s, spread, cap),
                   latency_on_last_turn=True)


def stale_policy_of(run_cfg: Any) -> tuple[str, int, bool]:
    """The run's stale policy as simulate's (policy, slack over max_staleness, drain)."""
    s = run_cfg.system.stale
    return s.policy, s.slack, s.drain
