"""Rewards from models, for tasks without a verifier: a reward model (a Hugging Face
sequence-classification model with one label, `reward.model.path`), a generative judge
(tiderl/rewards/judge.py), or both, weighted with the environment's (rule) reward so that the
reward parts still sum to the reward. docs/rewards.md gives the formula and how the conversation is
read back from the trajectory's tokens. Evaluation is never shaped.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiderl.options import need, opt, section
from tiderl.rewards import judge
from tiderl.rewards.judge import Judge, JudgeOptions
from tiderl.types import Trajectory

__all__ = ["PART", "ModelRewards", "RewardConfig", "RewardModel", "RewardModelOptions", "conversation_of"]

PART = "reward_model"
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


@dataclass
class RewardModelOptions:
    """The `reward.model:` options."""

    path: str = opt("", "A Hugging Face sequence-classification model (num_labels=1) that scores each "
                        "training episode's conversation; '' = off (the environment's reward alone).")
    weight: float = opt(1.0, "Weight of the reward model's score in the training reward.")
    batch_size: int = opt(8, "Conversations per forward pass of the reward model.")
    max_tokens: int = opt(4096, "Longest conversation scored, in the reward model's tokens; a longer one "
                                "keeps its last max_tokens (the end of the episode).")

    def check(self, cfg: Any) -> None:
        need(self.batch_size >= 1, "batch_size", "must be >= 1", "use e.g. 8")
        need(self.max_tokens >= 1, "max_tokens", "must be >= 1", "use e.g. 4096")


@dataclass
class RewardConfig:
    """The `reward:` config section (config.py holds it)."""

    model: RewardModelOptions = section(RewardModelOptions, "A reward model's score in the training reward.")
    judge: JudgeOptions = section(JudgeOptions, "A generative judge's score in the training reward.")
    rule_weight: float = opt(1.0, "Weight of the environment's own (rule) reward in the training reward when "
                                  "reward.model.path or reward.judge.url is set.")
    batch_wait_s: float = opt(0.05, "Seconds a finished episode waits for others to be scored with it (a batch is "
                                    "also scored once it holds the largest reward.*.batch_size episodes).")
    timeout_s: float = opt(600.0, "Seconds one batch of episodes may take to score (0 = no limit); past it each "
                                  "of its episodes fails with the tasks named, and is retried.")

    def check(self, cfg: Any) -> None:
        need(self.batch_wait_s >= 0, "batch_wait_s", "must be >= 0", "use e.g. 0.05")
        need(self.timeout_s >= 0, "timeout_s", "must be >= 0 (0 = no limit)", "use e.g. 600")

    def unread(self, cfg: Any) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, on, what in (("model", self.model.path, "path"), ("judge", self.judge.url, "url")):
            if not on:
                kind = RewardModelOptions if name == "model" else JudgeOptions
                out.update({f"{name}.{f.name}": f"reward.{name}.{what} is '', so nothing reads it"
                            for f in dataclasses.fields(kind) if f.name != what})
        if not (self.model.path or self.judge.url):
            out.update(dict.fromkeys(("batch_wait_s", "timeout_s"), "neither reward.model.path nor reward.judge.url "
                                     "is set: nothing is scored"))
            out["rule_weight"] = ("neither reward.model.path nor reward.judge.url is set: the environment's reward "
                                  "is used as is")
        return out


def conversation_of(text: str) -> list[dict[str, str]]:
    """The messages of a decoded episode: its ChatML turns, else one user message of all of it."""
    turns = [{"role": role, "content": content.strip("\n")} for role, content in _TURN.findall(text)]
    return turns or [{"role": "user", "content": text}]


class RewardModel:
    """A sequence-classification model that scores conversations, in batches."""

    def __init__(self, model: Any, tokenizer: Any, options: RewardModelOptions) -> None:
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(f"reward.model.path: the model has num_labels={model.config.num_labels}; a reward "
                             "model gives one score. Fix: use a sequence-classification model with num_labels=1")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer, self.options = model.eval(), tokenizer, options

    @classmethod
    def from_config(cls, cfg: Any) -> RewardModel:
        """The reward model of `cfg.reward`, on the policy's device and dtype."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from tiderl.models.loading import _resolve_dtype

        path = cfg.reward.model.path
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            dtype = _resolve_dtype(cfg.model.dtype)
            model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward.model.path={path!r}: cannot load a sequence-classification model and its "
                             f"tokenizer ({exc}). Fix: point it at a saved reward model directory") from None
        return cls(model.to(cfg.model.device), tokenizer, cfg.reward.model)

    def scores(self, conversations: Sequence[list[dict[str, str]]], task_ids: Sequence[str] = ()) -> list[float]:
        """One score per conversation, `batch_size` at a time. A failure names the tasks of its batch."""
        import torch

        out: list[float] = []
        ids = list(task_ids) or [f"#{i}" for i in range(len(conversations))]
        step = self.options.batch_size
        for start in range(0, len(conversations), step):
            batch, names = conversations[start:start + step], ids[start:start + step]
            try:
                rows = [self.token_ids(c)[-self.options.max_tokens:] for c in batch]
                width = max(len(r) for r in rows)
                pad = self.tokenizer.pad_token_id
                # Left padding: the classification head reads the last non-pad token either way.
                input_ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
                device = next(self.model.parameters()).device
                with torch.no_grad():
                    logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
                out += [float(v) for v in logits[:, 0].float().cpu()]
            except Exception as exc:  # noqa: BLE001 - say which tasks, keep the cause
                raise RuntimeError(f"reward model {self.options.path or '(in memory)'} failed on task(s) "
                                   f"{', '.join(map(str, names))}: {exc!r}") from exc
        return out

    def token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation in the reward model's chat template, as its token ids."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])



class ModelRewards:
    """The scorers of `reward.*` (part -> (weight, scorer with `scores(conversations, task_ids)`))
    combined with the rule reward by weights (module docstring)."""

    def __init__(self, scorers: dict[str, tuple[float, Any]], rule_weight: float, policy_tokenizer: Any) -> None:
        self.scorers, self.rule_weight, self.policy_tokenizer = scorers, rule_weight, policy_tokenizer

    @classmethod
    def from_config(cls, cfg: Any, policy_tokenizer: Any) -> ModelRewards | None:
        """The reward model and judge that `cfg.reward` sets (None when neither)."""
        r = cfg.reward
        scorers = {PART: (r.model.weight, RewardModel.from_config(cfg))} if r.model.path else {}
        if r.judge.url:
            scorers[judge.PART] = (r.judge.weight, Judge(r.judge))
        return cls(scorers, r.rule_weight, policy_tokenizer) if scorers else None

    def conversation(self, trajectory: Trajectory) -> list[dict[str, str]]:
        """The trajectory's conversation, decoded with the policy's tokenizer."""
        return conversation_of(self.policy_tokenizer.decode(trajectory.tokens, skip_special_tokens=False))

    def shape(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """The trajectories with reward' = rule_weight * reward + the weighted scores (module docstring)."""
        for t in trajectories:
            for part in set(self.scorers) & set(t.reward_parts):
                raise ValueError(f"trajectory of task {t.task_id!r} already has a '{part}' reward part: score it once")
        conversations, ids = [self.conversation(t) for t in trajectories], [t.task_id for t in trajectories]
        scores = {part: scorer.scores(conversations, ids) for part, (_, scorer) in self.scorers.items()}
        shaped = []
        for i, t in enumerate(trajectories):
            parts = {name: self.rule_weight * value for name, value in t.reward_parts.items()}
            parts.update({part: weight * scores[part][i] for part, (weight, _) in self.scorers.items()})
            info = {**t.env_info, **{f"{part}/score": scores[part][i] for part in self.scorers}}
            reward = self.rule_weight * t.reward + sum(parts[part] for part in self.scorers)
            shaped.append(dataclasses.replace(t, reward=reward, reward_parts=parts, env_info=info))
        return shaped
