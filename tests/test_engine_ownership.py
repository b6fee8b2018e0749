"""Who owns the model's weights: an engine copies the model it is given (training keeps
its own), unless the caller hands the model over (`make_engine(..., copy_model=False)`), which
`tiderl eval` does, so that an evaluation holds one set of weights, not two. Handing over changes
no completion."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from tiderl.cli import main
from tiderl.config import ConfigError, load_config
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.envs.setup import load_setup
from tiderl.models.loading import save_model_dir
from tiderl.rollout import make_engine
from tiderl.rollout.base import SamplingParams

CORPUS = [
    f"<|im_start|>user\nWho directed film_{i:03d}? It stars person_{i % 17}.<|im_end|>\n"
    f"<|im_start|>assistant\nperson_{(i * 7) % 23} directed film_{i:03d}.<|im_end|>\n"
    for i in range(40)
]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=320)


def _model(tokenizer):
    return init_tiny_model(tiny_qwen2_config(len(tokenizer), max_position_embeddings=256), seed=0)


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _prompts(tokenizer):
    return [tokenizer.encode(text, add_special_tokens=False)[:n] for text, n in zip(CORPUS, (12, 5, 20))]


def test_make_engine_copies_by_default_and_takes_the_model_when_handed_over(tokenizer):
    cfg = load_config(None, [])
    model = _model(tokenizer)
    before = _storages(model)
    kept = make_engine(cfg, model, tokenizer, seed=3)  # training's engine
    assert kept.model is not model and not (_storages(kept.model) & before), \
        "the default engine must hold weights of its own, apart from the trained policy's"
    owned = make_engine(cfg, model, tokenizer, seed=3, copy_model=False)
    assert owned.model is model, "a handed-over model must be the engine's model, not a copy"
    # The engine re-lays out some layers (stacked projections) but allocates no second model:
    # every parameter it decodes with is the handed-over model's.
    assert {id(p) for p in owned.model.parameters()} == {id(p) for p in model.parameters()}
    assert not (_storages(owned.model) & _storages(kept.model))
    # Same seed, same prompts: the same completions, tokens and log-probs, copied or handed over.
    prompts = _prompts(tokenizer)
    a, b = kept.generate(prompts, PARAMS), owned.generate(prompts, PARAMS)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-6)


def test_a_user_engine_is_built_with_the_documented_call(tokenizer):
    """A user's engine ("module:Class") is built as docs/extending.md says: `from_config(cfg, model,
    tokenizer, *, seed, copy_model)`; a class without it is a config error naming the fix."""
    cfg = load_config(None, [f"rollout.engine={__name__}:PlainEngine"])
    model = _model(tokenizer)
    owned = make_engine(cfg, model, tokenizer, seed=7, copy_model=False)
    assert isinstance(owned, PlainEngine) and owned.model is model and owned.seed == 7
    assert make_engine(cfg, model, tokenizer, seed=0).model is not model  # copied by default
    with pytest.raises(ConfigError, match="rollout.engine: .*:NoFromConfig has no classmethod from_config.*Fix"):
        load_config(None, [f"rollout.engine={__name__}:NoFromConfig"])


class PlainEngine:
    """A user's engine with the documented construction protocol (and no options of its own)."""

    @classmethod
    def from_config(cls, cfg, model, tokenizer, *, seed, copy_model):
        return cls(copy.deepcopy(model) if copy_model else model, seed)

    def __init__(self, model, seed):
        self.model, self.seed = model, seed


class NoFromConfig:
    def __init__(self, model, tokenizer, device="cpu", seed=0, max_batch_size=64):
        self.model = model


def _small_eval_model(tmp_path):
    """Overrides for a 4-task embedded evaluation, and a 1-layer model directory fit for it."""
    small = ["env.options.num_films=20", "env.options.num_people=20", "env.options.num_train_tasks=50", "data.eval_size=4",
             "eval.sampled=false", "env.max_turns=1", "rollout.max_new_tokens=4", "env.max_total_tokens=4096",
             "train.micro_batch_tokens=4096", "model.tiny.max_positions=4096", f"run_dir={tmp_path / 'run'}"]
    setup = load_setup(load_config(None, small))
    env = setup.make_env()
    texts = [env.system_prompt(), json.dumps(env.tool_schemas())] + [t.prompt for t in setup.eval_tasks]
    tok = train_tokenizer(texts * 3, vocab_size=400)
    path = save_model_dir(init_tiny_model(tiny_qwen2_config(len(tok), hidden_size=32, num_layers=1, num_heads=2,
                                                            num_kv_heads=1, max_position_embeddings=4096), seed=0),
                          tok, tmp_path / "model")
    return small, path


def test_eval_hands_its_policy_to_the_engine_and_trims_the_heap(tokenizer, tmp_path, monkeypatch):
    """`tiderl eval` builds its engine with the loaded policy handed over (one copy of the weights)
    and returns free heap pages while it evaluates."""
    import tiderl.evaluate
    import tiderl.rollout

    small, path = _small_eval_model(tmp_path)
    built = []
    real = tiderl.rollout.make_engine

    def spy(cfg, model, tokenizer, seed, copy_model=True):
        engine = real(cfg, model, tokenizer, seed, copy_model=copy_model)
        built.append((copy_model, engine.model is model))
        return engine

    monkeypatch.setattr(tiderl.rollout, "make_engine", spy)
    trimming = []
    real_trimmed_heap = tiderl.evaluate.trimmed_heap

    @contextlib.contextmanager
    def watched_trimmed_heap(*args, **kwargs):
        with real_trimmed_heap(*args, **kwargs) as calls:
            trimming.append("on")
            yield calls
        trimming.append("off")

    monkeypatch.setattr(tiderl.evaluate, "trimmed_heap", watched_trimmed_heap)
    assert main(["eval", "--model", str(path), *small, "model.chat_template=chatml",
                 "--json", str(tmp_path / "out.json")]) == 0
    assert built == [(False, True)], "eval must hand its policy to the engine, not keep a second copy"
    assert trimming == ["on", "off"], "eval must return free heap pages while it runs"
    assert json.loads((tmp_path / "out.json").read_text())["greedy"]["episodes"] == 4


def test_eval_runs_a_lora_checkpoint_on_its_base_model_unmerged(tmp_path, monkeypatch):
    """`tiderl eval --model <LoRA run>/checkpoints/.../actor` evaluates the adapters on the base
    model they name, through the unmerged LoRA engine, handed over (no second copy)."""
    pytest.importorskip("peft")
    import tiderl.rollout
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.rollout.lora import LoraTorchEngine
    from tiderl.train.lora import apply_lora, policy_state

    small, base = _small_eval_model(tmp_path)
    policy = apply_lora(load_model(base), r=2, alpha=4.0, target_modules=["q_proj", "down_proj"])
    g = torch.Generator().manual_seed(0)
    policy.load_state_dict({k: torch.randn(v.shape, generator=g) for k, v in policy_state(policy).items()},
                           strict=False)
    actor = save_model_dir(policy, load_tokenizer(base), tmp_path / "ckpt" / "actor")
    built = []
    real = tiderl.rollout.make_engine

    def spy(cfg, model, tokenizer, seed, copy_model=True):
        engine = real(cfg, model, tokenizer, seed, copy_model=copy_model)
        built.append((type(engine), copy_model, engine.model.model.layers[0].self_attn.q_proj.lora_b.shape))
        return engine

    monkeypatch.setattr(tiderl.rollout, "make_engine", spy)
    assert main(["eval", "--model", str(actor), *small, "model.chat_template=chatml",
                 "--json", str(tmp_path / "out.json")]) == 0
    assert built == [(LoraTorchEngine, False, (32, 2))]
    assert json.loads((tmp_path / "out.json").read_text())["greedy"]["episodes"] == 4


def _mapped(path: Path) -> list[tuple[int, int]]:
    """The address ranges where `path` is memory-mapped in this process (Linux)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_a_handed_over_model_leaves_the_loaders_memory_map(tokenizer, tmp_path):
    """A model loaded from safetensors is a view of the file's memory map, all of it resident; an
    engine that takes the model over copies its tensors out, so the map (a second copy of most
    weights beside the engine's re-laid-out ones) is released."""
    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs Linux's /proc/self/maps")
    from tiderl.models.loading import load_model
    from tiderl.rollout.torch_engine import TorchEngine

    path = save_model_dir(_model(tokenizer), tokenizer, tmp_path / "model")
    weights = next(path.glob("*.safetensors")).resolve()
    model = load_model(path, dtype="float32")
    tensors = [*model.parameters(), *model.buffers()]
    ranges = _mapped(weights)
    if not any(lo <= t.data_ptr() < hi for t in tensors for lo, hi in ranges):
        pytest.skip("this loader copied the weights out of the file: nothing to release")
    del tensors
    engine = TorchEngine(model, tokenizer, copy_model=False)
    assert engine.model is model
    ranges = _mapped(weights)
    inside = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
              if any(lo <= t.data_ptr() < hi for lo, hi in ranges)]
    assert not inside, f"still views of the file's memory map: {inside[:3]}"
    assert not ranges, "the weights file is still mapped (and its pages resident)"
    prompts = _prompts(tokenizer)
    reference = TorchEngine(_model(tokenizer), tokenizer, seed=1)
    owned = TorchEngine(load_model(path, dtype="float32"), tokenizer, seed=1, copy_model=False)
    assert [c.token_ids for c in reference.generate(prompts, PARAMS)] == \
        [c.token_ids for c in owned.generate(prompts, PARAMS)]


@pytest.mark.timeout(60)  # a trimming thread that never called would hang the wait below
def test_trimmed_heap_trims_while_the_block_runs_and_stops_after(monkeypatch):
    import tiderl.evaluate

    calls, called = [], threading.Event()
    monkeypatch.setattr(tiderl.evaluate, "_malloc_trim",
                        lambda: (lambda pad: calls.append(pad) or called.set() or 1))
    with tiderl.evaluate.trimmed_heap(interval_s=0.01) as done:
        called.wait()
    assert calls and set(calls) == {0} and done[0] == len(calls)
    after = len(calls)
    time.sleep(0.05)
    assert len(calls) == after, "the trimming thread must stop with the block"
    assert not [t for t in threading.enumerate() if t.name == "tiderl-heap-trim"]
    with tiderl.evaluate.trimmed_heap(interval_s=0) as done:  # off
        time.sleep(0.03)
    assert done == [0]


@pytest.mark.timeout(60)  # a thread that stopped trimming would hang the wait below
def test_trimmed_heap_runs_the_real_malloc_trim_where_there_is_one():
    import tiderl.evaluate

    if tiderl.evaluate._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    with tiderl.evaluate.trimmed_heap(interval_s=0.01) as done:
        blocks = [bytearray(300_000) for _ in range(50)]  # heap churn for it to return
        del blocks[::2]
        while done[0] < 2:
            time.sleep(0.01)
    assert done[0] >= 2


def test_the_http_engine_takes_the_model_as_its_reference_when_handed_over(tmp_path):
    pytest.importorskip("httpx")
    from support import CORPUS, StubServer, peaky_model

    tok = train_tokenizer(CORPUS, vocab_size=320)
    model = peaky_model(len(tok), seed=0)
    server = StubServer(model, tok)
    try:
        cfg = load_config(None, ["rollout.engine=http", f"rollout.options.urls=[{server.url}]", f"run_dir={tmp_path}"])
        kept = make_engine(cfg, model, tok, seed=0)
        owned = make_engine(cfg, model, tok, seed=0, copy_model=False)
        try:
            assert kept.reference is not model and owned.reference is model
            assert owned.state_checksum() == kept.state_checksum()  # the same weights passed the probe
        finally:
            kept.close()
            owned.close()
    finally:
        server.close()
