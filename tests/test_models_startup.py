"""Start-up checks (`tiderl.models.startup`): a chat template that drops the tools, a budget the
prompts do not fit and a budget beyond the model's positions are errors naming the fix, before
any episode; `model.chat_template` swaps in a template that shows the tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiderl.agent.chat import chat_format
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.agent.tool_parser import tool_call_format_of
from tiderl.cli import main
from tiderl.config import load_config
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.envs.setup import load_setup
from tiderl.models.loading import save_model_dir
from tiderl.models.startup import CHATML_TOOLS_TEMPLATE, StartupError, apply_chat_template, check_model_and_budgets
from tiderl.rollout.base import SamplingParams

# A ChatML template that, like SmolLM2's, never looks at `tools`.
TOOLLESS_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

SMALL = ["env.options.num_films=20", "env.options.num_people=20", "env.options.num_train_tasks=50", "data.eval_size=8"]


@pytest.fixture(scope="module")
def setup_and_cfg():
    cfg = load_config(None, SMALL)
    return cfg, load_setup(cfg)


@pytest.fixture(scope="module")
def toolless_dir(tmp_path_factory, setup_and_cfg):
    """A tiny model dir whose template ignores tools, with 512 positions."""
    cfg, setup = setup_and_cfg
    env = setup.make_env()
    texts = [env.system_prompt(), json.dumps(env.tool_schemas())] + [t.prompt for t in setup.eval_tasks]
    tok = train_tokenizer(texts * 3, vocab_size=400)
    tok.chat_template = TOOLLESS_TEMPLATE
    model = init_tiny_model(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                              max_position_embeddings=512), seed=0)
    return save_model_dir(model, tok, tmp_path_factory.mktemp("toolless"))


def _tokenizer(path: Path):
    from tiderl.models.loading import load_tokenizer

    return load_tokenizer(path)


def test_template_that_drops_tools_is_an_error_naming_the_fix(toolless_dir, setup_and_cfg):
    cfg, setup = setup_and_cfg
    with pytest.raises(StartupError) as err:
        check_model_and_budgets(cfg, _tokenizer(toolless_dir), setup, 512)
    message = str(err.value)
    assert "get_relations" in message and "model.chat_template=chatml" in message


def test_eval_refuses_a_template_that_drops_tools(toolless_dir, capsys):
    # Before the check, this evaluation ran and reported success 0 for a model that never saw the tools.
    code = main(["eval", "--model", str(toolless_dir), *SMALL, "eval.sampled=false"])
    assert code == 2
    assert "does not show the tools" in capsys.readouterr().err


def test_chatml_fallback_shows_every_tool_and_assembles_turns(toolless_dir, setup_and_cfg):
    base, setup = setup_and_cfg
    cfg = load_config(None, SMALL + [f"model.path={toolless_dir}", "model.chat_template=chatml", "model.tool_call_format=hermes",
                                     "env.max_total_tokens=4096", "train.micro_batch_tokens=4096"])
    tok = _tokenizer(toolless_dir)
    report = check_model_and_budgets(cfg, tok, setup, 4096)
    assert report.template == "tiderl's built-in 'chatml'" and tok.chat_template == CHATML_TOOLS_TEMPLATE
    assert tool_call_format_of(tok) == "hermes"
    assert report.prompt_tokens > 0 and report.prompts_checked == 16
    # An episode with a call and a tool response renders as the template does.
    env = setup.make_env()
    task = setup.eval_tasks[0]
    call = '<tool_call>\n{"name": "get_relations", "arguments": {"variable": "x"}}\n</tool_call>'
    engine = ScriptedEngine(tok, {task.prompt: [call, "Final Answer: #0"]})
    [traj] = play_episodes(engine, tok, setup.make_env, [task], SamplingParams(max_new_tokens=64),
                           max_turns=3, max_total_tokens=4000)
    text = tok.decode(traj.tokens)
    for tool in env.tool_schemas():
        assert tool["function"]["name"] in text
    assert "<|im_start|>user\n<tool_response>\n" in text and traj.num_turns == 2
    fmt = chat_format(tok, env.tool_schemas())
    assert fmt.end_of_turn == "<|im_end|>"


def test_chat_template_from_a_file_and_bad_values(tmp_path, toolless_dir):
    tok = _tokenizer(toolless_dir)
    path = tmp_path / "t.jinja"
    path.write_text(CHATML_TOOLS_TEMPLATE)
    assert apply_chat_template(tok, str(path)) == str(path) and tok.chat_template == CHATML_TOOLS_TEMPLATE
    with pytest.raises(StartupError, match="neither a built-in template"):
        apply_chat_template(tok, str(tmp_path / "missing.jinja"))
    plain = train_tokenizer(["no chatml tokens here"] * 3, vocab_size=300)
    plain.add_special_tokens({"additional_special_tokens": []})
    # A tokenizer without the ChatML tokens cannot take the ChatML template.
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(StartupError, match="no single token '<\\|im_start\\|>'"):
        apply_chat_template(PreTrainedTokenizerFast(tokenizer_object=bare), "chatml")


def test_budget_the_prompts_do_not_fit_is_an_error_with_a_size(toolless_dir, capsys):
    # Today's default budget (320) against these prompts: every episode would end with 0 tokens.
    code = main(["eval", "--model", str(toolless_dir), *SMALL, "model.chat_template=chatml",
                 "eval.sampled=false", "env.max_total_tokens=128", "rollout.max_new_tokens=64"])
    err = capsys.readouterr().err
    assert code == 2
    assert "env.max_total_tokens=128 leaves no room for a model turn" in err
    suggested = int(err.split("Fix: env.max_total_tokens=")[1].split()[0])
    assert suggested % 256 == 0 and suggested > 128


def test_model_path_budget_is_checked_against_the_model_positions(toolless_dir, capsys):
    # model.path= used to skip any position check; the tiny one's limit was checked instead.
    code = main(["eval", f"model.path={toolless_dir}", *SMALL, "model.chat_template=chatml",
                 "eval.sampled=false", "env.max_total_tokens=1024", "train.micro_batch_tokens=4096"])
    assert code == 2
    assert "max_position_embeddings=512" in capsys.readouterr().err


def test_model_flag_is_not_held_to_the_tiny_models_limits(toolless_dir, capsys):
    # --model DIR with a budget above model.tiny.max_positions used to be a config error about
    # a model that is not used.
    code = main(["eval", "--model", str(toolless_dir), "--dry-run", "env.max_total_tokens=1024",
                 "train.micro_batch_tokens=4096"])
    out = capsys.readouterr().out
    assert code == 0 and f"path: {toolless_dir}" in out
