"""End to end on CPU: build a tiny embedded model, run a few SAO steps, check what moved."""

import json

import pytest
import torch

from support import SMALL, rollout, small_config
from tiderl.recipe import train
from tiderl.run import build_run
from tiderl.train.batching import collate
from tiderl.train.checkpoint import load_checkpoint, save_checkpoint
from tiderl.train.forward import token_logprobs
from tiderl.types import NO_VERSION

pytestmark = pytest.mark.slow


def params_of(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_sao_steps_end_to_end(cache, tmp_path):
    cfg = small_config(cache, tmp_path / "run")
    run = build_run(cfg)
    assert run.engine.version == 0

    # Rollouts carry masks, versions and log-probs, and the engine's log-probs are the trainer's.
    trajectories = rollout(run, run.tasks.take(8))
    assert len(trajectories) == 8
    for t in trajectories:
        assert t.num_action_tokens > 0
        assert len(t.tokens) <= cfg.env.max_total_tokens
        sampled = [v for v, m in zip(t.policy_version, t.loss_mask) if m]
        forced = [v for v, m in zip(t.policy_version, t.loss_mask) if not m]
        assert set(sampled) == {0} and set(forced) == {NO_VERSION}
        assert all(lp < 0 or m == 0 for lp, m in zip(t.behavior_logprobs, t.loss_mask))
        assert t.stop_reason in ("answer", "max_turns", "max_tokens")
    batch = collate(trajectories, run.tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = token_logprobs(run.actor.model.eval(), batch.input_ids,
                                       batch.attention_mask)
    mask = batch.action_mask > 0
    max_diff = (recomputed[mask] - batch.behavior_logprobs[mask]).abs().max().item()
    print(f"max |behavior_logprobs - trainer recompute| = {max_diff:.2e}")
    assert max_diff < 1e-4

    with torch.no_grad():
        run.critic.model.head.bias.fill_(0.5)
    actor_before = params_of(run.actor.model)
    critic_before = params_of(run.critic.model)
    trained_versions = []  # (trainer version, sampled versions of every trained token)

    def observer(version, metrics, batch):
        trained_versions.append((version - 1, {v for t in batch for v, m in zip(t.policy_version, t.loss_mask) if m}))

    history, summary = train(run, observer=observer)
    assert len(history) == 3 and run.step == 3 and run.engine.version == 3
    # system.max_staleness=0 (the default) is on-policy: every trained token was sampled by the
    # very weights the step trains, and nothing was dropped as stale.
    assert trained_versions == [(0, {0}), (1, {1}), (2, {2})]
    assert summary["ledger"]["trained"] == 24 and summary["ledger"]["dropped_stale"] == 0

    # Step 1 is the critic-only warm-up: the actor has no policy metrics there.
    assert "policy/loss" not in history[0] and "policy/loss" in history[1]
    for h in history:
        for k, v in h.items():
            assert v == v and abs(v) != float("inf"), f"{k} is not finite: {v}"
    changed = [k for k in actor_before if not torch.equal(actor_before[k],
                                                          run.actor.model.state_dict()[k])]
    assert changed, "actor weights did not change"
    critic_after = run.critic.model.state_dict()
    assert not torch.equal(critic_before["head.weight"], critic_after["head.weight"])
    # Frozen attention stayed frozen.
    for k in critic_before:
        if "self_attn" in k:
            assert torch.equal(critic_before[k], critic_after[k]), k

    # The engine samples with the trained weights (the sync happened and matches).
    engine_state = run.engine.model.state_dict()
    for k, v in run.actor.model.state_dict().items():
        assert torch.equal(engine_state[k], v), k

    # Metrics reached JSONL and TensorBoard.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_checkpoint_resumes_exactly(cache, tmp_path):
    cfg = small_config(cache, tmp_path / "a", "train.steps=1")
    run = build_run(cfg)
    train(run)
    ckpt = save_checkpoint(tmp_path / "ckpt", run.step, run.actor, run.critic, run.tokenizer)

    resumed = build_run(small_config(cache, tmp_path / "b", f"train.resume={ckpt}",
                                     "train.steps=2"))
    assert resumed.step == 1 and resumed.engine.version == 1
    for k, v in run.actor.model.state_dict().items():
        assert torch.equal(resumed.actor.model.state_dict()[k], v), k
    for k, v in run.critic.model.state_dict().items():
        assert torch.equal(resumed.critic.model.state_dict()[k], v), k
    assert (resumed.actor.optimizer.state_dict()["state"].keys()
            == run.actor.optimizer.state_dict()["state"].keys())
    train(resumed)
    assert resumed.step == 2

    with pytest.raises(FileNotFoundError, match="train.resume"):
        load_checkpoint(tmp_path, run.actor, run.critic)


def test_demo_and_eval_commands(cache, tmp_path, capsys):
    from tiderl.cli import main

    args = ["--config", "configs/kg_sao_tiny.yaml", *SMALL, f"model.cache_dir={cache}",
            "train.steps=2", "data.eval_size=8", "eval.sampled=false"]
    assert main(["demo", "--run-dir", str(tmp_path / "demo"), *args]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    for key in ("success_before", "success_after", "n_eval", "stderr_before", "stderr_after",
                "wall_s"):
        assert key in summary, key
    assert summary["n_eval"] == 8 and summary["samples_per_task"] == 1 and summary["steps"] == 2 and summary["wall_s"] > 0
    assert f"summary: {tmp_path / 'demo' / 'summary.json'}" in out
    assert "held-out success (greedy, n=8)" in out

    actor = tmp_path / "demo" / "checkpoints" / "final" / "actor"
    results = tmp_path / "eval.json"
    assert main(["eval", "--model", str(actor), "--json", str(results), *args]) == 0
    greedy = json.loads(results.read_text())["greedy"]
    # Greedy decoding is deterministic: evaluating the saved actor reproduces the demo's
    # after-training figure.
    assert greedy["n"] == 8 and greedy["success"] == summary["success_after"]
    assert set(greedy["by_hops"]) <= {"1", "2"}


def test_embedded_build_is_deterministic_and_reloads(tmp_path):
    from safetensors.torch import load_file

    from tiderl.embedded.build import build_embedded_model
    from tiderl.envs.setup import load_setup
    from tiderl.models.loading import load_model, load_tokenizer

    cfg = small_config(tmp_path, tmp_path / "run", "model.warmstart.steps=5",
                       "model.warmstart.num_traces=60")
    setup = load_setup(cfg)
    a = build_embedded_model(cfg, setup, tmp_path / "a", log=lambda _: None)
    b = build_embedded_model(cfg, setup, tmp_path / "b", log=lambda _: None)
    assert a["sft_loss_last"] == b["sft_loss_last"]
    wa, wb = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "a", tmp_path / "b"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    # A normal Hugging Face model dir with a chat template.
    tok = load_tokenizer(tmp_path / "a")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert load_model(tmp_path / "a").config.model_type == "qwen2"
