"""A LoRA run holds its base weights once: the LoRA critic's backbone, the KL reference and the
HTTP engine's probe reference are the policy's own frozen tensors, not copies (they never change:
only adapters and the value head train). Checked by storage, and by training: a run with the
weights shared trains exactly as one with copies, and leaves the base weights as loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support import length_reward_overrides, parity_model_dir
from tiderl.config import load_config
from tiderl.models.loading import load_model
from tiderl.run import build_run
from tiderl.train.critic import ValueModel
from tiderl.train.lora import adapter_state, apply_lora


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return parity_model_dir(tmp_path_factory.mktemp("shared"))


def overrides(model, run_dir, *more):
    """support's tiny LengthReward SAO run with a LoRA policy and no critic warm-up."""
    return length_reward_overrides(model, run_dir, "algo.critic_warmup_steps=0", "model.lora.r=4", *more)


def frozen(module: torch.nn.Module) -> set[int]:
    """The storages of `module`'s frozen parameters."""
    return {p.untyped_storage().data_ptr() for p in module.parameters() if not p.requires_grad}


def storage_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct parameter storages the modules hold together."""
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for m in modules for p in m.parameters()}
    return sum(seen.values())


def test_the_lora_critic_and_the_reference_hold_the_policys_base_weights(model, tmp_path):
    run = build_run(load_config(None, overrides(model, tmp_path / "a", "model.critic_lora=lora")))
    policy, critic = run.actor.model, run.critic.model
    assert frozen(critic.backbone) and frozen(critic.backbone) <= frozen(policy)
    assert not {p.untyped_storage().data_ptr() for p in critic.parameters() if p.requires_grad} & frozen(policy)
    assert storage_bytes(policy, critic) < 1.1 * storage_bytes(policy)
    grpo = [o for o in overrides(model, tmp_path / "b", "algo.name=grpo", "algo.group_size=2", "algo.kl_coef=0.05")
            if not o.startswith(("algo.critic_lr", "algo.critic_warmup_steps"))]
    ref_run = build_run(load_config(None, grpo))
    assert frozen(ref_run.ref) and frozen(ref_run.ref) <= frozen(ref_run.actor.model)
    # A fully trained critic's backbone changes: it gets its own copy.
    full = build_run(load_config(None, overrides(model, tmp_path / "c", "model.critic_lora=full")))
    assert not {p.untyped_storage().data_ptr() for p in full.critic.model.parameters()} & frozen(full.actor.model)


@pytest.mark.slow
def test_a_run_with_shared_base_weights_trains_as_one_with_copies(model, tmp_path, monkeypatch):
    """Two SAO steps (LoRA policy and critic): every metric and every trained weight equal those of
    the same run whose critic copies the base; the base weights stay as loaded."""
    from tiderl.recipe import train

    shared = build_run(load_config(None, overrides(model, tmp_path / "shared", "model.critic_lora=lora",
                                                   "train.steps=2")))
    train(shared)
    original = ValueModel.from_policy.__func__
    monkeypatch.setattr(ValueModel, "from_policy",
                        classmethod(lambda cls, policy, share_weights=False: original(cls, policy, False)))
    copied = build_run(load_config(None, overrides(model, tmp_path / "copied", "model.critic_lora=lora",
                                                   "train.steps=2")))
    assert not frozen(copied.critic.model) & frozen(copied.actor.model)
    train(copied)

    def rows(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/", "step_s")) and not k.endswith("idle_frac")}
                for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(tmp_path / "shared"), rows(tmp_path / "copied")
    assert [{k: (v, y.get(k)) for k, v in x.items() if y.get(k) != v} for x, y in zip(a, b)] == [{}, {}]
    for a, b in ((shared.actor.model, copied.actor.model), (shared.critic.model, copied.critic.model)):
        theirs = b.state_dict()
        for k, v in a.state_dict().items():
            assert torch.equal(v, theirs[k]), k
    loaded = load_model(model).state_dict()
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in shared.actor.model.state_dict().items() if ".lora_" not in k}
    assert base.keys() == loaded.keys() and all(torch.equal(v, loaded[k]) for k, v in base.items())


def test_the_http_engines_reference_shares_the_frozen_base_and_copies_the_adapters(model):
    from tiderl.rollout.lora import unmerged_plain

    policy = apply_lora(load_model(model), r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    reference, layers, _ = unmerged_plain(policy, share_frozen=True)
    assert frozen(policy) == {p.untyped_storage().data_ptr() for p in reference.parameters()}
    probe_before = {k: v.clone() for k, v in reference.state_dict().items()}
    with torch.no_grad():  # the trainer's next step moves its adapters: the reference keeps its own
        for v in adapter_state(policy).values():
            v.add_(1.0)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in probe_before.items())
    modules = dict(reference.named_modules())
    assert all(getattr(modules[name], "lora_a", None) is not None for name in layers)
    # Without sharing (the LoRA torch engine, which re-lays its weights out), a copy of its own.
    copy_of_its_own, _, _ = unmerged_plain(policy)
    assert not frozen(policy) & {p.untyped_storage().data_ptr() for p in copy_of_its_own.parameters()}


def test_the_base_copies_benchmark_runs_and_counts_fewer_bytes_shared():
    """benchmarks/lora_base_copies.py --quick: both modes in processes of their own, and the
    shared one holds fewer weight bytes (the tiny shape: its r = 16 adapters are large beside a
    64-wide base, so the ratio is about 2, not the 0.5B shape's 2.7)."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "lora_base_copies.py"), "--quick"], check=True,
                         capture_output=True, text=True, cwd=root).stdout.strip().splitlines()
    assert [line.split(":")[0].strip() for line in out[:2]] == ["copies", "shared"]
    ratio = float(re.search(r"\(ratio ([0-9.]+)\)", out[-1]).group(1))
    assert ratio > 1.5, out[-1]
