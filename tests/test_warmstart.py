"""`tiderl warmstart`: a model dir fine-tuned on the oracle's demonstrations of training tasks
(never held-out ones), in the RL token layout; its greedy answers then follow them."""

from __future__ import annotations

import pytest
import torch

from tiderl.cli import main
from tiderl.config import load_config
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.embedded.tiny_vlm import oracle_texts
from tiderl.envs.setup import load_setup
from tiderl.models.loading import load_model, save_model_dir
from tiderl.models.warmstart import demonstrations, warm_start
from tiderl.train.batching import collate
from tiderl.train.forward import token_logprobs

SMALL = ["env.options.num_films=40", "env.options.num_people=40", "data.eval_size=8", "rollout.max_new_tokens=64",
         "env.max_total_tokens=512", "log.progress=false", "train.micro_batch_tokens=1024"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny untrained model whose tokenizer knows the KG oracle's turns."""
    root = tmp_path_factory.mktemp("warm")
    setup = load_setup(load_config("configs/kg_sao_tiny.yaml", SMALL))
    tasks = setup.train_tasks[:30] + setup.eval_tasks
    tokenizer = train_tokenizer(oracle_texts(setup.make_env(), tasks, {t.task_id: setup.oracle(t) for t in tasks}) * 2,
                                vocab_size=600)
    model = init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2,
                                              num_kv_heads=1), seed=0)
    return save_model_dir(model, tokenizer, root / "model")


def config(model_dir, tmp_path, *more):
    return load_config("configs/kg_sao_tiny.yaml", SMALL + [f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}",
                                                            *more])


def demo_loss(path, demos) -> float:
    """Mean negative log-likelihood of the demonstrations' assistant tokens under the model at `path`."""
    model = load_model(path)
    batch = collate(demos, pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    return float(-(lp * batch.action_mask).sum() / batch.action_mask.sum())


@pytest.mark.slow
def test_warm_start_learns_the_demonstrations_of_training_tasks_only(model_dir, tmp_path):
    cfg = config(model_dir, tmp_path)
    setup = load_setup(cfg)
    held_out = {t.task_id for t in setup.eval_tasks}
    asked = []
    oracle = setup.oracle
    setup.oracle = lambda task: asked.append(task.task_id) or oracle(task)
    report = warm_start(cfg, tmp_path / "warm", count=16, epochs=8, batch_size=8, lr=1e-2, setup=setup,
                        log=lambda _: None)
    assert len(asked) == report.tasks == 16 and not held_out & set(asked)
    assert 0 < report.demonstrations <= 16 and report.assistant_tokens > 0
    assert len(report.losses) == round(8 * report.demonstrations / 8) and report.losses[-1] < 0.5 * report.losses[0]
    # The saved dir is a plain model that reproduces the demonstrations far better than before.
    from tiderl.models.loading import load_tokenizer

    _, demos = demonstrations(cfg, setup, load_tokenizer(model_dir), 16, cfg.seed)
    assert demo_loss(report.out, demos) < 0.5 * demo_loss(model_dir, demos)


@pytest.mark.slow
def test_warm_start_with_lora_saves_merged_weights(model_dir, tmp_path):
    pytest.importorskip("peft")
    cfg = config(model_dir, tmp_path, "model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj,up_proj,down_proj]")
    report = warm_start(cfg, tmp_path / "warm", count=16, epochs=4, batch_size=8, lr=1e-2, log=lambda _: None)
    saved = load_model(report.out)
    assert not any("lora_" in k for k in saved.state_dict())  # a plain model, adapters merged
    before = load_model(model_dir).state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in saved.state_dict().items() if "q_proj" in k)
    assert report.losses[-1] < report.losses[0]


def test_warm_start_refuses_what_it_cannot_do(model_dir, tmp_path, capsys):
    cfg = config(model_dir, tmp_path)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="new --out"):
        warm_start(cfg, tmp_path / "taken", count=4, log=lambda _: None)
    with pytest.raises(ValueError, match="model.warmstart"):
        warm_start(config("tiny", tmp_path), tmp_path / "a", count=4, log=lambda _: None)
    setup = load_setup(cfg)
    setup.oracle = None
    with pytest.raises(ValueError, match="no scripted oracle"):
        warm_start(cfg, tmp_path / "b", count=4, setup=setup, log=lambda _: None)
    assert main(["warmstart", "--config", "configs/kg_sao_tiny.yaml", "--out", str(tmp_path / "taken"), *SMALL,
                 f"model.path={model_dir}"]) == 2
    assert "new --out" in capsys.readouterr().err
