"""The real-model recipes load and validate, with SAO's published learning rates (not the tiny
model's) and budgets that hold the prompts measured with Qwen2.5-Coder's template."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiderl.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# Longest prompt over 50 held-out tasks with Qwen2.5-Coder-0.5B-Instruct's own template
# (tiderl eval prints it at start-up): MetaQA 773, AgentBench DB dev 643.
LONGEST_PROMPT = {"kg": 773, "db": 643}


@pytest.mark.parametrize("env", ["kg", "db"])
def test_qwen_recipes_validate_with_paper_learning_rates_and_fitting_budgets(env):
    cfg = load_config(CONFIGS / f"qwen2.5-coder-0.5b_{env}_sao.yaml")
    assert cfg.algo.name == "sao" and cfg.env.name == env
    assert (cfg.algo.actor_lr, cfg.algo.critic_lr) == (1e-6, 5e-6)
    assert cfg.model.path.endswith("models/qwen2.5-coder-0.5b-instruct") and cfg.model.tool_call_format == "auto"
    # Room for the prompt and every turn at full length, plus observations.
    assert LONGEST_PROMPT[env] + cfg.env.max_turns * cfg.rollout.max_new_tokens < cfg.env.max_total_tokens
    assert cfg.train.micro_batch_tokens >= cfg.env.max_total_tokens
