"""The run-level config: one typed tree for every tiderl command.

Every run-level field is declared here with its default and its documentation (`help`); each
component declares its own options beside its code (`tiderl/options.py`; which lives where:
docs/architecture.md, "What each folder owns"). Configs come from YAML files plus dotted
command-line overrides (`algo.critic_lr=5e-6`). Unknown keys (with a did-you-mean), wrong types,
keys that the run's other choices leave unread and keys that moved into a component's options
are rejected naming the field and the fix. This module does not import torch.
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
from tiderl.algos.registry import AlgoConfig
from tiderl.embedded.options import TinyModelConfig, WarmStartConfig
from tiderl.envs import registration as environments
from tiderl.metrics.trackers import check_trackers
from tiderl.options import (
    ConfigError,
    build,
    check_components,
    component_options,
    fill_component_defaults,
    need,
    opt,
    reject_former_keys,
    section,
    unread_keys,
)
from tiderl.rewards.curiosity import CuriosityConfig
from tiderl.rewards.model import RewardConfig
from tiderl.system.staleness import StaleOptions
from tiderl.train.lora import LoraSettings


@dataclass
class ModelConfig:
    """Which policy model to train."""

    path: str = opt("tiny", "A Hugging Face causal-LM directory (config + safetensors + tokenizer with a chat "
                    "template), or 'tiny' for the embedded default built and cached by tiderl.")
    cache_dir: str = opt("", "Where the embedded default is cached ('' = $TIDERL_CACHE or ~/.cache/tiderl).")
    dtype: str = opt("float32", "Weights dtype.", ("float32", "bfloat16", "float16"))
    device: str = opt("cpu", "Torch device for trainer and engine ('cpu', 'cuda', 'cuda:1').")
    tiny: TinyModelConfig = section(TinyModelConfig, "Shape of the embedded default model.")
    warmstart: WarmStartConfig = section(WarmStartConfig, "Supervised warm-start of the tiny model.")
    tool_call_format: str = opt("auto", "How the model writes tool calls: 'hermes' (<tool_call>{json}</tool_call>), "
                                "'json' (a fenced ```json block or a bare JSON object/list with name and arguments, "
                                "as Qwen2.5-Coder writes), or 'auto' (both).", ("auto", "hermes", "json"))
    chat_template: str = opt("", "Replace the tokenizer's chat template: '' = keep it, 'chatml' = tiderl's ChatML "
                             "template with tools (for models whose own template ignores tools=), or a path to a "
                             "Jinja template file.")
    lora: LoraSettings = section(LoraSettings, "LoRA adapters on the policy (on the critic too with model.critic_lora=lora).")
    critic_lora: str = opt("full", "The critic's backbone: full (fully trained) or lora (model.lora's adapters on "
                           "it, base frozen; the value head trains fully).", ("full", "lora"))


@dataclass
class DataConfig:
    """Where tasks come from and how they are split (what else shapes the tasks is the
    environment's own options, `env.options`)."""

    source: str = opt("", "Where the environment's tasks come from: one of the sources the environment registers ('' "
                      "= its first; `tiderl config` lists each environment's, docs/env_*.md describe them). A user's "
                      "environment without registered sources reads it as it likes.")
    split: str = opt("", "The held-out split to evaluate on, for sources that have several ('' = the source's default).")
    data_dir: str = opt("", "Root of the shared benchmark data ('' = $TIDERL_DATA_DIR or ../shared/data).")
    eval_size: int = opt(200, "Held-out questions per evaluation (fixed-seed sample).")
    seed: int = opt(0, "Seed of the world, the questions and the split.")
    train_files: list[str] = opt([], "Your own training tasks, in place of the source's: JSONL files, Parquet files or "
                                 "folders saved by datasets' save_to_disk (these two need pyarrow, the `data` extra; "
                                 "kg also reads MetaQA's question<TAB>answers .txt files), for an environment that "
                                 "reads files (math, code, kg; the others refuse them). A relative path not found "
                                 "from the working directory is read under the data root (data.data_dir), e.g. "
                                 "[gsm8k/train.jsonl].")
    eval_files: list[str] = opt([], "Your own held-out tasks, likewise, in place of the source's (a fixed-seed sample of "
                                "at most data.eval_size).")
    fields: dict[str, str] = opt({}, "Which field of a record holds what, e.g. {question: problem, answer: solution} "
                                 "({} = the common formats as they are; the roles: math question/answer/id, code "
                                 "question/tests/entry_point/reference/id, kg question/answer/topic/path/id; "
                                 "docs/env_*.md).")

    def check(self, cfg: Any) -> None:
        roles = environments.task_fields(cfg.env.name)
        need(roles is None or set(self.fields) <= set(roles), "fields", f"names {sorted(self.fields)}",
             f"map only {', '.join(roles or ())} to a record's field names")

    def unread(self, cfg: Any) -> dict[str, str]:
        files = environments.reads_task_files(cfg.env.name)
        return {} if files else dict.fromkeys(("train_files", "eval_files", "fields"),
                                              f"env.name={cfg.env.name} reads no task files")


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
    tool_latency_spread: float = opt(1.0, "uniform: half-width as a fraction of the mean; lognormal: sigma of "
                                     "log-latency.")
    tool_latency_max_s: float = opt(0.0, "Cap on one simulated latency (0 = no cap).")
    tool_error_penalty: float = opt(
        0.0, "Training reward lost per failed tool call (env_info['tool_errors']: malformed or unknown "
        "calls, wrong arguments, a tool's own error), counting at most env.max_turns of them; 0 = off. "
        "A dense signal while success is rare; with every outcome 0 it is gamed by calling fewer tools "
        "(measured in docs/real_models.md). Evaluation is never shaped (tiderl/rewards/tool_errors.py).")
    no_call_penalty: float = opt(0.0, "Training reward lost per turn with no tool call that did not end the episode "
                                 "(env_info['no_call_turns'], counted by the agent loop: turns that got the "
                                 "environment's nudge); 0 = off. Closes the path that games env.tool_error_penalty "
                                 "(prose instead of calls), but with every outcome 0 both together are gamed by "
                                 "committing a guess at once (docs/real_models.md). An answer that ends the episode, "
                                 "such as a math answer in text, is never charged.")
    options: Any = component_options(
        environments.ENVIRONMENT_OPTIONS, "The chosen environment's own options (`Options` of what env.name "
        "names; `tiderl config` lists each environment's).")

    def __post_init__(self) -> None:
        fill_component_defaults(self)


@dataclass
class RolloutConfig:
    """Sampling, and the engine that samples."""

    temperature: float = opt(1.0, "Sampling temperature (SAO: 1.0). The trainer scores tokens at the same "
                             "temperature (logits / T), as the engine's behaviour log-probs are, so fresh "
                             "data has ratio 1 at any T > 0; 0 = greedy, scored at 1.")
    top_p: float = opt(1.0, "Nucleus sampling (SAO: 1.0). The trainer does not truncate: below 1, behaviour "
                       "log-probs exceed the trainer's by the nucleus's log-mass, so keep 1.0 for training.")
    max_new_tokens: int = opt(64, "Tokens per model turn.")
    batch_size: int = opt(32, "Trajectories per optimizer step (one rollout per prompt for SAO).")
    engine_batch_size: int = opt(64, "Largest batch the engine decodes at once.")
    engine: str = opt("torch", "Inference engine: 'torch' (batched KV-cache sampling with any Hugging Face causal "
                      "LM, CPU or GPU), 'http' (an OpenAI-compatible server such as vLLM) or a user's 'module:Class' "
                      "with the Engine methods and from_config (docs/extending.md).")
    options: Any = component_options(
        registry.ENGINE_COMPONENTS, "The chosen engine's own options (`Options` of what rollout.engine names; "
        "`tiderl config` lists each engine's).")

    def __post_init__(self) -> None:
        fill_component_defaults(self)


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
    keep_best: bool = opt(False, "Keep `checkpoints/best`: the full checkpoint of the step whose held-out "
                          "eval/success (eval.every) is the highest so far.")
    skip_zero_advantage: bool = opt(
        True, "Leave trajectories whose advantages are all exactly 0 (e.g. a GRPO group of equal rewards) "
              "out of the actor's forward/backward when that cannot change the gradient: a policy loss "
              "that vanishes at A=0, no KL in the loss, no entropy bonus. The update is the same up to "
              "float rounding; the actor's per-token metrics then cover only the trajectories trained on.")
    nonfinite: str = opt("error", "A NaN/inf reward, loss or gradient: 'error' stops the step naming the "
                                  "task; 'skip' leaves the trajectory out (or skips the optimizer step) "
                                  "and counts it (nonfinite/*).", ("error", "skip"))
    reproducible: bool = opt(False, "Make a max_staleness=0 run repeatable bit for bit on CPU, and its resume exact: "
                             "the local engine decodes only once every running episode has asked for its turn, "
                             "however long its tools take (no 20 ms patience), and critic/reference preparations run "
                             "one trajectory at a time. Needs system.trainer_threads > 0 (a fixed thread count).")
    parallel: str = opt("none", "Data-parallel trainer: none (one process: the driver), ddp or fsdp2 "
                        "(train.world_size ranks as Ray actors in a placement group, torch.distributed with gloo on "
                        "CPU and NCCL on GPU; with system.backend=local, on a local Ray started for them). The loss "
                        "and gradients equal the single-process ones. docs/ray.md", ("none", "ddp", "fsdp2"))
    world_size: int = opt(1, "Trainer ranks with train.parallel=ddp/fsdp2 (one process, and with "
                          "model.device=cuda one GPU, each).")
    rank_resources: dict[str, float] = opt(
        {}, "Extra Ray resources each trainer rank's placement-group bundle asks for, beside its CPU (and "
        "GPU): custom node labels declared with `ray start --resources`, e.g. {trainer_node: 1}, to "
        "place the ranks on chosen nodes (docs/ray.md).")
    placement: str = opt("pack", "How the trainer ranks' placement group spreads over nodes: pack (as few nodes as "
                         "possible) or spread (one rank per node where it can).", ("pack", "spread"))
    activation_checkpointing: bool = opt(False, "Recompute each decoder layer's activations in the backward pass "
                                         "instead of keeping them (policy and critic): much less activation memory "
                                         "per micro-batch for about a third more compute; gradients are unchanged.")
    autocast: str = opt("none", "Mixed precision of training passes: none (the weights' dtype) or bfloat16 "
                        "(torch.autocast over fp32 master weights: matmuls in bf16, weights, gradients and AdamW "
                        "state in fp32).", ("none", "bfloat16"))


@dataclass
class EvalConfig:
    """Held-out evaluation."""

    greedy: bool = opt(True, "Report greedy decoding.")
    sampled: bool = opt(True, "Report sampling at the rollout temperature.")
    pass_k: int = opt(1, "Also report pass@k from k samples per task (1 = off).")
    every: int = opt(0, "During training, evaluate the trained weights on held-out tasks every N steps and at the "
                     "last step, in the modes above (0 = off): eval/* in metrics.jsonl (docs/metrics.md).")
    before: bool = opt(False, "Also evaluate the starting weights once before the first step (not on resume), in "
                       "the modes above: eval/* at step 0 in metrics.jsonl, the figure the run's are compared with.")
    n: int = opt(0, "Held-out tasks per evaluation during training: the first n of the setup's (0 = all of them, "
                 "at most data.eval_size).")


@dataclass
class SystemConfig:
    """How rollout and training are scheduled (see docs/architecture.md, "System")."""

    backend: str = opt("local", "Where episodes run (the rollout pool and the loop are the same for all): local (in "
                       "this process), ray (rollout workers as Ray actors), agent (an external agent's sessions "
                       "through tiderl serve's API), or a user's 'module:Class' with from_run (docs/extending.md).")
    options: Any = component_options(
        registry.BACKEND_COMPONENTS, "The chosen backend's own options (`Options` of what system.backend names; "
        "`tiderl config` lists each backend's).")
    max_staleness: int = opt(0, "Versions the engine's weights may lag the trainer when an episode starts (0 = on-policy, "
                             "synchronous); its trained tokens may lag max_staleness + system.stale.slack.")
    stale: StaleOptions = section(StaleOptions, "What trains of an episode with tokens older than the bound.")
    partial_rollout: str = opt("continue", "What in-flight episodes do when new weights arrive: continue on them "
                               "(per-token versions) or restart from scratch.", ("continue", "restart"))
    slots: int = opt(0, "Concurrent rollout slots at start (0 = (max_staleness+1) x batch).")
    min_slots: int = opt(0, "Elastic lower bound on slots (0 = `slots`: no shrinking).")
    max_slots: int = opt(0, "Elastic upper bound on slots (0 = `slots`: no growing).")
    elastic_interval_s: float = opt(2.0, "Seconds between elastic capacity decisions.")
    max_task_retries: int = opt(2, "Times a failed episode's task is retried before it counts as failed.")
    wait_timeout_s: float = opt(600.0, "Longest any wait (for a batch, weights, a worker) may take before the run "
                                "fails.")
    trainer_threads: int = opt(0, "torch CPU threads for training. At max_staleness=0 decoding, preparation and "
                               "training run in one thread (they never overlap) and 0 = the cores other processes "
                               "leave free, measured as it runs; with max_staleness > 0 the trainer has its own "
                               "thread and 0 = the half of the cores that decoding does not get.")
    decode_threads: int = opt(0, "torch CPU threads of the local engine's decode thread when it has its own "
                              "(max_staleness > 0; 0 = half the cores, at least one).")
    prep_threads: int = opt(
        1, "torch CPU threads of the preparation thread (critic values, reference log-probs; 0 = one "
        "per core). It runs beside decoding, so one thread keeps it from crowding the engine out.")
    resource_units: float = opt(
        1.0, "Devices the run holds (GPUs; the machine for a CPU run): `throughput/goodput_tokens_per_s_per_unit` "
        "divides goodput by it, so runs on different hardware compare per device.")
    cores: str = opt("shared", "Cores per component (tiderl.system.cores): 'shared' (no pinning), 'auto' (with "
                     "max_staleness > 0 the trainer gets the first half of the cores, rollout and preparation the "
                     "rest; synchronous training keeps every core), or a plan such as 'trainer=0;rollout=1' "
                     "(optionally ';prep=1'). A pinned component's *_threads default to its core count.")
    admission: int = opt(
        0, "Most trajectories started and not yet settled (0 = (max_staleness+1) x batch). Above "
        "batch_size at max_staleness=0: over-provisioned on-policy training, where the first "
        "batch_size finishers train and the rest restart on the new weights. Also the default slots.")

    def __post_init__(self) -> None:
        fill_component_defaults(self)


@dataclass
class LogConfig:
    """Where metrics go."""

    tensorboard: bool = opt(True, "Also write TensorBoard event files.")
    progress: bool = opt(True, "Show a progress bar.")
    transcripts: int = opt(0, "Training episodes per step written as transcripts (0 = none): appended to "
                           "run_dir/transcripts/train.jsonl with their step, the latest step's also as "
                           "transcripts/train_latest.md. Rewarded episodes first, then in batch order.")
    trackers: list[str] = opt([], "Experiment trackers that also get every step's metrics and the resolved config: "
                              "wandb (WANDB_MODE=offline works, WANDB_DIR), mlflow (MLFLOW_TRACKING_URI, a local store "
                              "works); the `trackers` extra installs both.")

    def check(self, cfg: Any) -> None:
        check_trackers(self.trackers)


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
    reward: RewardConfig = section(RewardConfig, "A reward model's score in the training reward (docs/rewards.md).")
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
    written = _leaf_keys(data)
    reject_former_keys(RunConfig(), written)  # e.g. env.db_backend, rollout.http.urls, system.ray_workers
    cfg = build(RunConfig, {**data, "algo": algo}, "")
    validate(cfg)
    check_components(cfg)
    reject_ignored(cfg, written)
    return cfg


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of every value written in `tree` (a mapping value counts as a leaf only
    when it is not a config section, e.g. curiosity.kind_weights)."""
    out: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("kind_weights", "rank_resources", "fields", "server_resources"):
            out |= _leaf_keys(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _ignored_keys(cfg: RunConfig) -> dict[str, str]:
    """Run-level key -> why the run's other choices leave it unread. What a component's options
    leave unread (the algorithm's unchosen estimators and losses, the Ray workers' elastic
    settings, LoRA's) each declares itself: `unread`, `tiderl.options.unread_keys`. A backend's
    options may say that its capacity changes (`elastic`, as `RayOptions` do)."""
    s, e = cfg.system, cfg.env
    elastic = (s.min_slots or s.slots) != (s.max_slots or s.slots) or getattr(s.options, "elastic", False)
    rules = [
        (("train.world_size", "train.rank_resources", "train.placement"), cfg.train.parallel != "none",
         "train.parallel=none trains in one process"),
        (("system.elastic_interval_s",), elastic,
         "the rollout slots are fixed (system.min_slots and system.max_slots give no range, nor do the workers)"),
        (("system.partial_rollout",), s.max_staleness > 0,
         "at system.max_staleness=0 every episode of a step ends before the weights change"),
        (("model.critic_lora",), algo_registry.needs_critic(cfg.algo), f"algo.advantage={cfg.algo.advantage} trains "
         "no critic"),
        (("env.tool_latency_s", "env.tool_latency_max_s"), e.tool_latency != "none",
         "env.tool_latency=none adds no latency"),
        (("env.tool_latency_spread",), e.tool_latency in ("uniform", "lognormal"),
         f"env.tool_latency={e.tool_latency} has no spread"),
        (("eval.n",), cfg.eval.every > 0 or cfg.eval.before, "eval.every=0 and eval.before=false evaluate nothing during training"),
        (("train.keep_best",), cfg.eval.every > 0, "eval.every=0 evaluates nothing during training"),
    ]
    return {key: why for keys, used, why in rules if not used for key in keys}


def reject_ignored(cfg: RunConfig, written: set[str]) -> None:
    """Raise ConfigError for a key the config sets to a value of its own although nothing reads
    it under the config's other choices (a silently ignored key would make a run look
    configured when it is not)."""
    # A written key that holds its default (the preset's value for algorithm options) changes
    # nothing: resolved configs (run_dir/config.yaml) write every key and must load again.
    for key, why in {**unread_keys(cfg), **_ignored_keys(cfg)}.items():
        if key in written and _get(cfg, key) != _default(cfg, key):
            raise ConfigError(f"{key}: set to {_get(cfg, key)!r}, but {why}, so it would be ignored. "
                              f"Fix: remove {key}, or change the choice it depends on.", key)


def _default(cfg: RunConfig, key: str) -> Any:
    """The value of `key` when a config does not set it: its section's or options' default, the
    preset's for an algorithm option."""
    parent, _, leaf = key.rpartition(".")
    node = _get(cfg, parent)
    return getattr(AlgoConfig(**preset_defaults(cfg.algo.name)) if node is cfg.algo else type(node)(), leaf)


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
    sections and components that check their own options do it in `check`:
    `tiderl.options.check_components`)."""
    r, t, sysc, e = cfg.rollout, cfg.train, cfg.system, cfg.env
    need(r.temperature >= 0, "rollout.temperature", "must be >= 0", "use 1.0")
    need(0 < r.top_p <= 1, "rollout.top_p", f"{r.top_p} is outside (0, 1]", "use 1.0")
    need(r.batch_size >= 1, "rollout.batch_size", "must be >= 1", "use 32")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", "use 64")
    need(e.max_turns >= 1, "env.max_turns", "must be >= 1", "use 4")
    need(e.max_total_tokens > r.max_new_tokens, "env.max_total_tokens",
         "must exceed rollout.max_new_tokens", "raise env.max_total_tokens")
    need(t.steps >= 0, "train.steps", "must be >= 0", "use e.g. 100")
    need(t.checkpoint_every >= 0, "train.checkpoint_every", f"{t.checkpoint_every} must be >= 0",
         "use 0 (only the final checkpoint) or e.g. 50")
    need(t.checkpoint_every_s >= 0, "train.checkpoint_every_s", "must be >= 0", "use 0 (off) or e.g. 600")
    need(t.keep_last >= 0, "train.keep_last", "must be >= 0", "use 0 (keep all) or e.g. 3")
    need(cfg.log.transcripts >= 0, "log.transcripts", "must be >= 0", "use 0 (none) or e.g. 4")
    need(not t.reproducible or (sysc.max_staleness == 0 and sysc.trainer_threads > 0 and sysc.backend == "local"),
         "train.reproducible", "needs system.max_staleness=0 (asynchronous runs overlap on timing), a fixed "
         "system.trainer_threads (thread counts change float sums) and system.backend=local",
         "set system.max_staleness=0 system.trainer_threads=1 (or more), or train.reproducible=false")
    need(t.micro_batch_tokens >= e.max_total_tokens, "train.micro_batch_tokens",
         "must hold at least one whole episode (env.max_total_tokens)", "raise train.micro_batch_tokens")
    need(t.world_size >= 1, "train.world_size", "must be >= 1", "use 2 with train.parallel=fsdp2")
    need(t.parallel == "none" or t.world_size >= 2, "train.world_size",
         f"is {t.world_size} with train.parallel={t.parallel}: one rank is one process",
         "use train.world_size >= 2, or train.parallel=none")
    need(t.parallel == "none" or sysc.backend in ("ray", "local"), "train.parallel",
         f"{t.parallel} trains with rollouts on system.backend=ray or local, not {sysc.backend}",
         "set system.backend=ray or local, or train.parallel=none")
    need(t.autocast == "none" or cfg.model.dtype == "float32", "train.autocast",
         f"{t.autocast} keeps fp32 master weights, but model.dtype={cfg.model.dtype}",
         "use model.dtype=float32 with train.autocast=bfloat16")
    need(cfg.model.critic_lora == "full" or cfg.model.lora.r > 0, "model.critic_lora",
         "is lora and model.lora.r=0: the critic's adapters take model.lora's settings",
         "set model.lora.r (e.g. 8), or model.critic_lora=full")
    need(sysc.max_staleness >= 0, "system.max_staleness", "must be >= 0", "use 0 (synchronous) or e.g. 2")
    need(sysc.slots >= 0, "system.slots", "must be >= 0", "use 0 for (max_staleness+1) x batch")
    need(sysc.min_slots >= 0 and sysc.max_slots >= 0, "system.min_slots/max_slots",
         "must be >= 0", "use 0 to keep the slot count fixed")
    need(not (sysc.min_slots and sysc.max_slots) or sysc.min_slots <= sysc.max_slots,
         "system.min_slots", f"{sysc.min_slots} exceeds system.max_slots={sysc.max_slots}",
         "make min_slots <= max_slots")
    need(sysc.elastic_interval_s > 0, "system.elastic_interval_s", "must be > 0", "use 2.0")
    need(sysc.max_task_retries >= 0, "system.max_task_retries", "must be >= 0", "use 2")
    need(sysc.resource_units > 0, "system.resource_units", "must be > 0 (the devices the run holds)", "use 1")
    need(sysc.admission == 0 or sysc.admission >= r.batch_size, "system.admission",
         f"{sysc.admission} is below rollout.batch_size={r.batch_size}, so no batch could fill",
         "use 0 ((max_staleness+1) x batch) or at least the batch size, e.g. 2 x batch")
    if sysc.cores.strip() not in ("shared", "auto", ""):
        # The plan's syntax; whether its cores exist is checked when a run starts.
        from tiderl.system.cores import parse_plan

        try:
            parse_plan(sysc.cores)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    need(sysc.wait_timeout_s > 0, "system.wait_timeout_s", "must be > 0", "use 600")
    need(cfg.eval.pass_k >= 1, "eval.pass_k", "must be >= 1", "use 1 (off) or e.g. 4")
    need(cfg.eval.every >= 0 and cfg.eval.n >= 0, "eval.every/eval.n", "must be >= 0", "use 0 (off / all tasks)")
    need(not (cfg.eval.every or cfg.eval.before) or cfg.eval.greedy or cfg.eval.sampled or cfg.eval.pass_k > 1,
         "eval.every" if cfg.eval.every else "eval.before",
         "asks for evaluations with every mode off", "set eval.greedy=true or eval.sampled=true")
    need(e.max_items >= 1, "env.max_items", "must be >= 1", "use 100")
    need(e.max_observation_chars >= 100, "env.max_observation_chars", "must be >= 100", "use 4000")
    need(e.tool_latency_s >= 0, "env.tool_latency_s", "must be >= 0", "use e.g. 0.2")
    need(e.tool_error_penalty >= 0, "env.tool_error_penalty", "must be >= 0", "use 0 (off) or e.g. 0.05")
    need(e.no_call_penalty >= 0, "env.no_call_penalty", "must be >= 0", "use 0 (off) or e.g. 0.05")
    need(e.tool_latency_spread >= 0, "env.tool_latency_spread", "must be >= 0", "use 1.0")
    need(e.tool_latency == "none" or e.tool_latency_s > 0, "env.tool_latency_s",
         f"is 0 but env.tool_latency is {e.tool_latency!r}", "set env.tool_latency_s > 0 or env.tool_latency=none")
    _check_source(cfg)


def _check_source(cfg: RunConfig) -> None:
    """data.source must be one of the sources the environment registers (when it registers any)."""
    sources = environments.sources(cfg.env.name)
    readers = [name for name in registry.ENVIRONMENTS if cfg.data.source in environments.sources(name)]
    elsewhere = f", or env.name={readers[0]}, which reads it" if readers else ""
    need(not sources or cfg.data.source in sources, "data.source",
         f"env.name={cfg.env.name} reads {', '.join(sources)}, not {cfg.data.source!r}",
         f"use one of those{elsewhere}")


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML, in declaration order."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def describe(cls: type = RunConfig, prefix: str = "", chosen: Any = None) -> list[tuple[str, str, Any]]:
    """(dotted key, help, default) for every leaf field: the config reference, with each built-in
    environment's, engine's and backend's options (and, given a loaded config as `chosen`, those of
    its components that are a user's own). `tiderl config` prints it."""
    return _options.describe(cls, prefix, chosen)
