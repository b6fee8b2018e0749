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


@pytest.mark.parametrize("env", ["kg", "db"])
def test_the_cpu_lora_recipes_train_adapters_on_a_bf16_base_with_the_full_recipes_prompts(env):
    cfg = load_config(CONFIGS / f"qwen2.5-coder-0.5b_{env}_sao_lora_cpu.yaml")
    full = load_config(CONFIGS / f"qwen2.5-coder-0.5b_{env}_sao.yaml")
    assert cfg.algo.name == "sao" and cfg.env.name == env and cfg.env.system_prompt == full.env.system_prompt
    assert cfg.model.dtype == "bfloat16" and cfg.model.lora.r > 0 and cfg.model.critic_lora == "lora"
    # LoRA's usual 10x over the full fine-tuning rates of the paper.
    assert (cfg.algo.actor_lr, cfg.algo.critic_lr) == pytest.approx((10 * full.algo.actor_lr, 10 * full.algo.critic_lr))
    assert cfg.data.eval_size == 100 and cfg.data.split == ("standard" if env == "db" else full.data.split)
    assert LONGEST_PROMPT[env] + cfg.env.max_turns * cfg.rollout.max_new_tokens < cfg.env.max_total_tokens
    assert cfg.env.max_total_tokens <= cfg.train.micro_batch_tokens <= 2 * cfg.env.max_total_tokens


def test_the_1_5b_cpu_recipe_is_the_0_5b_one_on_the_larger_model_with_activation_checkpointing():
    cfg = load_config(CONFIGS / "qwen2.5-coder-1.5b_db_sao_lora_cpu.yaml")
    small = load_config(CONFIGS / "qwen2.5-coder-0.5b_db_sao_lora_cpu.yaml")
    assert cfg.model.path.endswith("models/qwen2.5-coder-1.5b-instruct") and cfg.train.activation_checkpointing
    assert not small.train.activation_checkpointing
    # Everything else, prompts and budgets included, is the 0.5B recipe's.
    assert (cfg.env, cfg.algo, cfg.rollout, cfg.data) == (small.env, small.algo, small.rollout, small.data)
    assert cfg.model.lora == small.model.lora and cfg.model.dtype == small.model.dtype == "bfloat16"


def test_the_gsm8k_cpu_recipe_trains_on_gsm8k_train_and_holds_out_its_test_file():
    cfg = load_config(CONFIGS / "qwen2.5-coder-0.5b_gsm8k_lora_cpu.yaml")
    assert cfg.algo.name == "sao" and cfg.env.name == "math" and not cfg.env.options.calculator
    # Training tasks from GSM8K's train file, held-out ones sampled from its test file (data.source).
    assert cfg.data.train_files == ["gsm8k/train.jsonl"] and cfg.data.source == "gsm8k" and not cfg.data.eval_files
    assert cfg.data.eval_size >= 200
    # fp32 on CPU: measured 2x faster than bf16 on an AVX2 CPU (no bf16 matmul units; docs/real_models.md).
    assert cfg.model.dtype == "float32" and cfg.model.lora.r > 0 and cfg.model.critic_lora == "lora"
    # The longest GSM8K prompt (train or test) is 238 tokens with Qwen2.5-Coder's template and the
    # environment's system prompt: it and a whole answer fit.
    assert 238 + cfg.rollout.max_new_tokens <= cfg.env.max_total_tokens <= cfg.train.micro_batch_tokens
