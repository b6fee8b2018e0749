"""Plain helpers that several test files share: constants, builders, a loopback server.

How the shared test code is laid out:

- `tests/conftest.py` holds the pytest fixtures that several files use (and the seeding every
  test starts from). A test gets a fixture by naming it as an argument, never by importing it.
- This module holds everything else that more than one test file uses: plain functions,
  constants and classes, imported as `from support import ...` (pytest puts `tests/` on
  `sys.path`; it has no `__init__.py`). Nothing here is a fixture or a test.
- A test file does not import another test file: what two files share moves here or to
  conftest.py.

Each section says which files use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.parse
from contextlib import contextmanager
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import torch

# Data structures and the tiny model are imported here; the config, run and training modules
# inside the helpers that use them, so that a file using only the KG or DB helpers does not fail
# to import when those modules do.
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.envs.db.backend import TableSpec
from tiderl.envs.kg.rdf import XSD, GraphSpec, RdfSchema
from tiderl.envs.kg.sparql import OxigraphClient
from tiderl.envs.kg.store import TripleStore
from tiderl.types import NO_VERSION, Trajectory

REPO_ROOT = Path(__file__).resolve().parents[1]


# -- chat formats (test_agent_loop, test_tool_parser_loop) -------------------------------------


def observation_ids(fmt, tool_messages: list[str]) -> list[int]:
    """Tokens that follow a finished assistant turn (ended by the end-of-turn token) when the
    environment answers with tool responses, up to and including the next generation prompt."""
    return fmt.continuation_ids([{"role": "tool", "content": m} for m in tool_messages])


def user_message_ids(fmt, content: str) -> list[int]:
    """Like `observation_ids`, for an environment that answers in a plain user turn."""
    return fmt.continuation_ids([{"role": "user", "content": content}])


# -- trajectories (test_agent_loop, test_system_pool, test_system_local, test_system_cores) ------


def versions(trajectory: Trajectory) -> set[int]:
    """The policy versions that sampled any token of `trajectory`."""
    return {v for v, m in zip(trajectory.policy_version, trajectory.loss_mask) if m}


# -- benchmark data ----------------------------------------------------------------------------


def data_roots() -> list[Path]:
    """Where tests look for the shared benchmark data, as tiderl does (`data_root`):
    $TIDERL_DATA_DIR when set (an empty folder there makes every data test skip), else
    ../shared/data beside the repository."""
    if os.environ.get("TIDERL_DATA_DIR"):
        return [Path(os.environ["TIDERL_DATA_DIR"])]
    return [REPO_ROOT.parent / "shared" / "data"]


def metaqa_dir() -> Path:
    """The MetaQA folder, or skip (test_kg_ceiling, test_kg_env_tasks)."""
    roots = data_roots()
    for root in roots:
        if (root / "metaqa" / "kb.txt").is_file():
            return root / "metaqa"
    pytest.skip(f"MetaQA data not found under {', '.join(map(str, roots))}: set TIDERL_DATA_DIR to the "
                "folder that holds metaqa/")


# -- the small hand-written knowledge graph (test_kg_*, test_robust_outputs) -----------------

# The graph:            F1 --directed_by--> D1 <--directed_by-- F2      F3 --directed_by--> D2
# starred_actors: F1 -> Ann Lee, F1 -> A2, F2 -> A2, F3 -> Ann Lee
# release_year:   F1 -> 1990, F2 -> 2001, F3 -> 2001      has_genre: F1 -> Drama, F3 -> Drama
TRIPLES = [
    ("F1", "directed_by", "D1"), ("F2", "directed_by", "D1"), ("F3", "directed_by", "D2"),
    ("F1", "starred_actors", "Ann Lee"), ("F1", "starred_actors", "A2"),
    ("F2", "starred_actors", "A2"), ("F3", "starred_actors", "Ann Lee"),
    ("F1", "release_year", "1990"), ("F2", "release_year", "2001"), ("F3", "release_year", "2001"),
    ("F1", "has_genre", "Drama"), ("F3", "has_genre", "Drama"),
]
LABELS = {"F1": "First Film", "A2": "Bo Chen"}
EX = "http://example.org/kg/"


def small_store() -> TripleStore:
    """TRIPLES in a TripleStore (release_year an attribute)."""
    store = TripleStore(attribute_relations={"release_year"})
    for s, r, o in TRIPLES:
        store.add(s, r, o)
    return store


SCHEMA = RdfSchema(namespaces=((EX, ""),))  # the small graph as RDF: attributes inferred from datatypes


def small_graph() -> GraphSpec:
    """TRIPLES with release years as xsd:integer literals, and the two LABELS."""
    return GraphSpec(
        edges=[t for t in TRIPLES if t[1] != "release_year"],
        values=[(s, r, o, XSD + "integer") for s, r, o in TRIPLES if r == "release_year"],
        labels=dict(LABELS),
    )


class _SparqlHandler(BaseHTTPRequestHandler):
    """GET ?query=..., POST form-encoded or application/sparql-query; JSON results."""

    def do_GET(self) -> None:
        self._answer(urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).get("query", [""])[0])

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode("utf-8")
        if self.headers.get("Content-Type", "").startswith("application/sparql-query"):
            self._answer(body)
        else:
            self._answer(urllib.parse.parse_qs(body).get("query", [""])[0])

    def _answer(self, query: str) -> None:
        import pyoxigraph

        self.server.methods.append(self.command)
        try:
            result = self.server.store.query(query)
            status, body = 200, result.serialize(format=pyoxigraph.QueryResultsFormat.JSON)
            kind = "application/sparql-results+json"
        except (SyntaxError, ValueError) as e:
            status, body, kind = 400, f"bad query: {e}".encode(), "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # keep test output clean
        pass


class QuietHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer for test stubs that stays silent when a client hangs up first.

    Tests time requests out on purpose (a slow judge, a delayed completion); the handler then
    writes to a closed socket some time later, and the default handle_error would print that
    traceback into whichever test is running by then (and into its captured stderr).
    (support, test_model_rewards, test_reward_scoring)"""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def sparql_server(ntriples: str) -> Iterator[tuple[str, list[str]]]:
    """A SPARQL 1.1 protocol server on loopback answering from a pyoxigraph store loaded with
    `ntriples`, at http://127.0.0.1:<free port>/sparql; yields (url, HTTP methods seen).
    (test_kg_backends, test_kg_agentbench, test_eval_cli)"""
    server = QuietHTTPServer(("127.0.0.1", 0), _SparqlHandler)
    server.store = OxigraphClient.from_rdf(ntriples, "nt").store
    server.methods = []
    # A short poll interval: shutdown() waits up to one interval.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/sparql", server.methods
    finally:
        server.shutdown()
        server.server_close()


# -- the schools table of the DB environment (test_db_backends, test_db_env) -----------------


SCHOOLS = TableSpec(
    name="School Location Table",
    columns=(("School", "TEXT"), ("Location", "TEXT"), ("Date moved", "YEAR"), ("Students", "INT")),
    rows=(
        ("Burroughs High School", "Ridgecrest", "1960", "1200"),
        ("Clovis High School", "Clovis", "1969", "2500"),
        ("Madison High School", "San Diego", "1980", "900"),
        ("Lincoln High School", "San Diego", "1955", "1500"),
        ("Central High School", "Fresno", "1969", None),
    ),
)
T = '"School Location Table"'  # the table's name, quoted for SQL

# Every backend stores these values: YEAR and INT cells become integers (SQLite by column
# affinity, the others by portable column types), text stays text.
STORED_ROWS = [
    ("Burroughs High School", "Ridgecrest", 1960, 1200),
    ("Clovis High School", "Clovis", 1969, 2500),
    ("Madison High School", "San Diego", 1980, 900),
    ("Lincoln High School", "San Diego", 1955, 1500),
    ("Central High School", "Fresno", 1969, None),
]


# -- a tiny run of the embedded KG world (test_e2e_sao and the tests that build such a run) --

SMALL = [
    "env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16",
    "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.warmstart.num_traces=200", "model.warmstart.steps=20", "model.warmstart.batch_size=16",
    "rollout.batch_size=8", "train.steps=3", "algo.critic_warmup_steps=1",
    "algo.actor_lr=1e-3", "algo.critic_lr=1e-3", "log.progress=false",
    # A 20-step warm-start rarely solves a task; without whitening, a critic that predicts 0.5
    # (set in test_e2e_sao) gives every sampled token a non-zero advantage, so the actor must move.
    "algo.normalize_advantages=false",
]


def small_config(cache, run_dir, *more):
    """configs/kg_sao_tiny.yaml made smaller (SMALL), its warm-started model cached in `cache`."""
    from tiderl.config import load_config

    return load_config("configs/kg_sao_tiny.yaml",
                       SMALL + [f"model.cache_dir={cache}", f"run_dir={run_dir}", *more])


def rollout(run, tasks):
    """One sampled episode per task with the run's engine."""
    from tiderl.agent.loop import play_episodes
    from tiderl.rollout.base import sampling_params

    params = sampling_params(run.cfg.rollout, run.tokenizer.eos_token_id, greedy=False)
    return play_episodes(run.engine, run.tokenizer, run.make_env, tasks, params, run.cfg.env.max_turns,
                         run.cfg.env.max_total_tokens)


# -- a peaky tiny model for the engines (test_torch_engine, test_http_engine, test_prefix_cache,
#    test_seeded_sampling; the fixtures `tokenizer`, `model`, `prompts` in conftest.py) --------

CORPUS = [
    f"<|im_start|>user\nWho directed film_{i:03d}? It stars person_{i % 17}.<|im_end|>\n"
    f"<|im_start|>assistant\nperson_{(i * 7) % 23} directed film_{i:03d}.<|im_end|>\n"
    for i in range(60)
]
PROMPT_LENGTHS = [3, 17, 1, 9, 30]  # different lengths, so that a batch is left-padded


def peaky_model(vocab_size: int, seed: int, max_positions: int = 256):
    """A random tiny model whose next-token distributions are far from uniform.

    The standard 0.02 init gives near-uniform logits; scaling the final norm multiplies the
    logits (and nothing else), so top-p, greedy and stopping tests see a real distribution.
    """
    model = init_tiny_model(tiny_qwen2_config(vocab_size, max_position_embeddings=max_positions), seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return model


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by repeated full forward passes (no cache, no padding)."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt):]


# -- one train_step on a 1-layer tiny model (test_algos_step, test_kl_clamp; the fixture
#    `trajectories` in conftest.py) -----------------------------------------------------------


STEP_MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                   max_position_embeddings=64)


def step_trajectories() -> list[Trajectory]:
    """8 trajectories in 2 groups of 4 with prompt, two turns and an observation between them.

    Behaviour log-probs are the seed-0 model's own plus noise (std 0.3), so ratios differ from 1
    and every clip/band is exercised the way a stale or mismatched engine would exercise it.
    """
    return _synthetic_trajectories(STEP_MODEL_CFG, 8, 6, lambda i: float(i in (0, 3, 5, 6)) + 0.1 * i, 4)


def _synthetic_trajectories(model_cfg, count: int, part_below: int, reward, group_size: int) -> list[Trajectory]:
    """`count` trajectories (prompt, turn, observation, turn; each part 2 to part_below-1 tokens)
    in groups of `group_size`, rewards `reward(i)`; behaviour log-probs are a seed-0 model's own plus
    noise (std 0.3). The same in every process (their own generator, a seeded model)."""
    from tiderl.train.forward import token_logprobs

    g = torch.Generator().manual_seed(0)
    model = init_tiny_model(model_cfg, seed=0)
    out = []
    for i in range(count):
        turn1, obs, turn2 = (int(torch.randint(2, part_below, (1,), generator=g)) for _ in range(3))
        mask = [0, 0, 0] + [1] * turn1 + [0] * obs + [1] * turn2
        tokens = torch.randint(3, 50, (len(mask),), generator=g).tolist()
        with torch.no_grad():
            ids = torch.tensor([tokens])
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        noise = torch.randn(len(mask), generator=g) * 0.3
        behavior = [float(lp[0, t] + noise[t]) if m else 0.0 for t, m in enumerate(mask)]
        out.append(Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior,
                              policy_version=[0 if m else NO_VERSION for m in mask],
                              reward=reward(i), group_id=f"q{i // group_size}"))
    return out


def step_critic(actor):
    """A critic from the actor with a seeded, non-zero head (so values and their targets vary)."""
    from tiderl.train.critic import ValueModel
    from tiderl.train.learner import Learner

    value_model = ValueModel.from_policy(actor.model)
    with torch.no_grad():
        value_model.head.weight.copy_(
            torch.randn(value_model.head.weight.shape, generator=torch.Generator().manual_seed(7))
            * 0.1)
    return Learner(value_model, lr=0.0, grad_clip=0.0)


def step_algo(name: str, **overrides):
    """The preset `name` with groups of at most 4 (the size of step_trajectories' groups)."""
    from tiderl.config import AlgoConfig, preset_defaults

    d = preset_defaults(name)
    d["group_size"] = min(d["group_size"], 4)
    d.update(overrides)
    return AlgoConfig(**d)


def flat_grads(learner) -> torch.Tensor:
    """All accumulated gradients of a learner as one vector."""
    return torch.cat([p.grad.flatten() for p in learner.params if p.grad is not None])


def step_grads(cfg, trajs, micro_batch_tokens: int):
    """Run one step with lr = 0 and no clipping; return (actor gradients, critic gradients or
    None, metrics)."""
    from tiderl.algos.registry import needs_critic, needs_ref
    from tiderl.train.learner import Learner
    from tiderl.train.step import train_step

    actor = Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=0.0, grad_clip=0.0)
    critic = step_critic(actor) if needs_critic(cfg) else None
    ref = init_tiny_model(STEP_MODEL_CFG, seed=1) if needs_ref(cfg) else None
    metrics = train_step(trajs, actor, critic, ref, cfg, pad_id=0,
                         micro_batch_tokens=micro_batch_tokens, train_actor=True)
    return flat_grads(actor), (flat_grads(critic) if critic is not None else None), metrics


# -- one train_step of a 2-layer tiny model on 9 trajectories, the same in every process
#    (test_parallel, test_parallel_nodes, test_sharded_checkpoint, test_lora,
#    test_activation_checkpointing) -------------------------------------------------------------

PARALLEL_MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                       max_position_embeddings=64)
LR, CLIP = 1e-3, 0.5  # a real step: a learning rate and a clip that bites


def nine_trajectories() -> list[Trajectory]:
    """9 trajectories of different lengths (prompt, turn, observation, turn), rewards in 3 groups;
    the same in every process (their own generator, a seeded model)."""
    return _synthetic_trajectories(PARALLEL_MODEL_CFG, 9, 9, lambda i: float(i % 3 == 0) + 0.1 * i, 3)


def parallel_cases() -> dict:
    """{name: (AlgoConfig, micro-batch tokens)}: SAO (critic with frozen attention, GAE, DIS, two
    critic updates) and a PPO with recomputed old log-probs and a KL term in the loss against a
    reference (every no-grad pass of the step)."""
    from tiderl.config import AlgoConfig, preset_defaults

    def algo(name: str, **overrides) -> AlgoConfig:
        d = preset_defaults(name)
        d.update(group_size=min(d["group_size"], 3), **overrides)
        return AlgoConfig(**d)

    return {
        "sao": (algo("sao", critic_updates=2), 40),
        "ppo_kl": (algo("ppo", old_logprobs="recompute", kl_coef=0.1, entropy_coef=0.01), 64),
    }


def build(cfg, make_learner):
    """(actor, critic or None, reference or None) for `cfg`, each a seeded model wrapped by
    `make_learner(model, lr)`."""
    from tiderl.algos.registry import needs_critic, needs_ref
    from tiderl.train.critic import ValueModel, freeze_matching

    actor = make_learner(init_tiny_model(PARALLEL_MODEL_CFG, seed=0), LR)
    critic = None
    if needs_critic(cfg):
        value_model = ValueModel.from_policy(init_tiny_model(PARALLEL_MODEL_CFG, seed=0))
        with torch.no_grad():
            value_model.head.weight.copy_(torch.randn(value_model.head.weight.shape,
                                                      generator=torch.Generator().manual_seed(7)) * 0.1)
        freeze_matching(value_model, cfg.critic_freeze_pattern)
        critic = make_learner(value_model, LR)
    ref = init_tiny_model(PARALLEL_MODEL_CFG, seed=1) if needs_ref(cfg) else None
    return actor, critic, ref


def seed_adapters(model: torch.nn.Module, seed: int) -> None:
    """Set every adapter from a seeded generator: peft draws A from the global RNG (which the
    processes do not share) and starts B at 0, where A would get no gradient and the test would
    not see A's all-reduce."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def snapshot(learner) -> dict[str, torch.Tensor]:
    """Gradients and parameters after the step, whole (FSDP2 shards gathered), by name."""
    model = getattr(learner.model, "module", learner.model)
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[f"grad/{name}"] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        out[f"param/{name}"] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


# -- a stand-in for a vLLM server (test_http_engine, test_engine_ownership) --------------------


class _StubHandler(BaseHTTPRequestHandler):
    """The vLLM endpoints tiderl uses, answered by the server's TorchEngine."""

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _answer(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._answer(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
        return self._answer(404, {"detail": "Not Found"})

    def do_POST(self):
        from safetensors.torch import load_file

        from tiderl.rollout.base import SamplingParams

        body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
        stub = self.server.stub  # type: ignore[attr-defined]
        if self.path == "/v1/completions":
            stub.requests.append(body)
            prompt = body["prompt"]
            if body.get("model") != "stub" or not isinstance(prompt, list) or body.get("logprobs") != 0 \
                    or body.get("return_token_ids") is not True or body.get("ignore_eos") is not True:
                return self._answer(400, {"error": "the stub expects what HttpEngine sends", "body": body})
            # A request's `seed` gives it a random stream of its own, as vLLM's per-request seed
            # does: what it samples does not depend on the requests before it or beside it.
            params = SamplingParams(temperature=body["temperature"], top_p=body["top_p"],
                                    max_new_tokens=body["max_tokens"], stop=body.get("stop", []),
                                    stop_token_ids=body.get("stop_token_ids", []), seed=body.get("seed"))
            if stub.delay_s:
                time.sleep(stub.delay_s)
            (completion,) = stub.engine.generate([prompt], params)
            choice = {"index": 0, "text": completion.text, "token_ids": completion.token_ids,
                      "logprobs": {"token_logprobs": completion.logprobs,
                                   "tokens": [f"token_id:{t}" for t in completion.token_ids]},
                      "finish_reason": completion.finish_reason}
            return self._answer(200, {"object": "text_completion", "choices": [choice]})
        if self.path == "/collective_rpc" and body.get("method") == "reload_weights":
            state = load_file(str(Path(body["kwargs"]["weights_path"]) / "model.safetensors"))
            stub.engine.update_weights(state, stub.engine.version + 1)
            stub.reloads += 1
            return self._answer(200, {"results": [None]})
        if self.path == "/reset_prefix_cache":
            return self._answer(200, {"success": True})
        return self._answer(404, {"detail": "Not Found"})


class StubServer:
    """A ThreadingHTTPServer on a free local port that implements the vLLM endpoints tiderl uses
    (`/v1/models`, `/v1/completions` with token-id prompts, `/collective_rpc` reload_weights,
    `/reset_prefix_cache`); a TorchEngine holding `model` samples its completions. `requests`
    records the completion bodies, `delay_s` delays each completion."""

    def __init__(self, model, tokenizer):
        from tiderl.rollout.torch_engine import TorchEngine

        self.engine = TorchEngine(model, tokenizer, seed=0)
        self.requests: list[dict] = []
        self.reloads = 0
        self.delay_s = 0.0
        self.httpd = QuietHTTPServer(("127.0.0.1", 0), _StubHandler)
        self.httpd.stub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# -- watching a code sandbox's concurrency (test_sandbox, test_env_code) ------------------------


async def gather_watching(box, *awaitables) -> tuple[list, int]:
    """Await `awaitables` together while a task on the same event loop samples, every 10 ms, how
    many of the sandbox `box`'s executions hold a slot of this loop (`box._running`, the counts
    per event loop its `concurrency` bound is enforced on). Returns (results, the most seen at once). A peak above
    1 shows executions ran at the same time and that the event loop kept running meanwhile (an
    execution that blocked the loop would leave the sampler no moment to see two); no clock is
    read."""
    peak = 0

    async def sample() -> None:
        nonlocal peak
        loop = id(asyncio.get_running_loop())
        while True:
            peak = max(peak, box._running.get(loop, 0))
            await asyncio.sleep(0.01)

    sampler = asyncio.ensure_future(sample())
    try:
        results = await asyncio.gather(*awaitables)
    finally:
        sampler.cancel()
    return results, peak


# -- the tiny parity model of the resume and evaluation-during-training runs ----------------------

# Wall-clock figures differ between any two runs; everything else in a metrics row must be equal.
TIMED = ("time/", "throughput/", "step_s", "system/trainer_idle_frac", "system/rollout_idle_frac",
         "system/prep_overlap_frac")


def length_reward_overrides(model: Path, run_dir: Path, *more: str) -> list[str]:
    """A tiny synchronous, reproducible SAO run on `resume_env:LengthReward` with the parity model
    at `model`: 4 trajectories a step, one torch thread; `more` adds or overrides keys.
    (test_eval_during_training, test_lora_shared_base)"""
    return ["env.name=resume_env:LengthReward", "data.source=parity", f"model.path={model}", f"run_dir={run_dir}",
            "algo.name=sao", "algo.critic_warmup_steps=1", "algo.actor_lr=3e-3", "algo.critic_lr=1e-3",
            "rollout.batch_size=4", "env.max_turns=2", "env.max_total_tokens=200", "rollout.max_new_tokens=24",
            "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false",
            "system.trainer_threads=1", "system.decode_threads=1", "train.reproducible=true", *more]


def train_then_resume(make_args, folder: Path, steps: int = 3):
    """(a, b): run `a` trains `steps` steps with a checkpoint after each, reproducibly; run `b`, in a
    copy of a's run dir, resumes from step 1's checkpoint and trains to `steps`. `make_args(run_dir,
    *more)` gives a run's overrides. (test_vlm_run, test_gpu)"""
    import shutil

    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    exact = [f"train.steps={steps}", "train.checkpoint_every=1", "train.reproducible=true"]
    a = build_run(load_config(None, make_args(folder / "a", *exact)))
    train(a)
    shutil.copytree(folder / "a", folder / "b")
    b = build_run(load_config(None, make_args(folder / "b", *exact,
                                              f"train.resume={folder / 'b' / 'checkpoints' / 'step_1'}")))
    assert b.step == 1
    train(b)
    return a, b


def parity_model_dir(folder: Path) -> Path:
    """An untrained one-layer Qwen2 (seed 0) with a tokenizer trained on tests/user_env.py's
    corpus, saved as a Hugging Face directory under `folder`."""
    import user_env
    from tiderl.embedded.tiny import train_tokenizer
    from tiderl.models.loading import save_model_dir

    tokenizer = train_tokenizer(user_env.corpus(), vocab_size=300)
    model = init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=1, num_heads=2,
                                              num_kv_heads=1, max_position_embeddings=512), seed=0)
    return save_model_dir(model, tokenizer, folder / "model")


def local_ray_cluster(module_name: str) -> Iterator[None]:
    """A 2-CPU local Ray cluster for a test module's fixture (`yield from`); the module's own test
    classes travel by value, as Ray's workers cannot import a test module by name."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[module_name])
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # our own cluster, not a running one
    yield
    ray.shutdown()


def block_import(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Make every import of a module whose name starts with `prefix` raise ImportError (a package
    that is not installed), for the rest of the test."""
    import builtins

    real_import = builtins.__import__

    def blocked(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith(prefix):
            raise ImportError(f"no {prefix}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)


def kept_sessions(engine) -> int:
    """How many sessions have a kept prefix cache in a TorchEngine now."""
    with engine._inbox_lock:
        return len(engine._kept)


def give_own_behaviour_logprobs(model, trajectories, image_processor=None) -> None:
    """Scripted turns carry log-prob 0: give each sampled token the model's own log-prob, as if it
    had sampled the trajectories (images through `image_processor`)."""
    import torch

    from tiderl.train.batching import collate
    from tiderl.train.forward import token_logprobs

    batch = collate(trajectories, 0, image_processor)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    for row, t in enumerate(trajectories):
        t.behavior_logprobs = [float(x) if m else 0.0 for x, m in zip(lp[row, : len(t.tokens)], t.loss_mask)]


# -- a small knowledge-graph run (test_scale_matrix, test_http_launch, test_lora_http) ----------

# configs/kg_sao_tiny.yaml at toy size: a 2-layer tiny model warm-started for 2 steps, batches of 4.
SMALL_KG_RUN = ["env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16",
                "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
                "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.warmstart.num_traces=40",
                "model.warmstart.steps=2", "model.warmstart.batch_size=16", "rollout.batch_size=4",
                "algo.critic_warmup_steps=0", "env.max_turns=2", "rollout.max_new_tokens=16", "log.progress=false",
                "log.tensorboard=false", "system.wait_timeout_s=300"]


# -- launched inference servers (test_http_launch, test_collective_sync, test_lora_adapters_sync, ...) --


def wait_for_event(engine, kind: str, timeout_s: float = 90.0) -> dict:
    """The latest `kind` event of an HTTP engine's launched servers (or a `restart_failed`, which
    ends the wait too), waiting up to `timeout_s` for one."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = [e for e in engine.events if e["event"] in (kind, "restart_failed")]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no {kind!r} event within {timeout_s} s: {engine.events}")


@contextmanager
def two_steps_on_launched_servers(cache, folder: Path, overrides: list[str], loads: int):
    """Two steps of the small KG run through `tiderl train`'s path with `rollout.engine=http` and
    2 launched servers, plus `overrides`; checks the steps, the ledger, and that each server took
    `loads` weight loads and passes the probe at the end; yields (run, summary), then closes the
    engine (and its servers)."""
    import httpx

    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config("configs/kg_sao_tiny.yaml", SMALL_KG_RUN + [
        "train.steps=2", "rollout.engine=http", "rollout.options.launch=2", f"model.cache_dir={cache}",
        f"run_dir={folder / 'run'}"] + overrides))
    try:
        history, summary = train(run)
        assert [h["policy_version"] for h in history] == [1, 2]
        assert summary["ledger"]["trained"] == 8 and summary["ledger"]["failed"] == 0
        for url in run.engine.urls:
            assert httpx.get(url + "/health").json()["version"] == loads
            run.engine._check_probe(url, what="after the run")
        yield run, summary
    finally:
        run.engine.close()


# -- the learning tests (test_learning, test_learning_fast) ------------------------------------


def learning_cache(request, tmp_path: Path, name: str) -> Path:
    """A model cache that outlives the test: pytest's cache folder `name` (so a CI that keeps
    `.pytest_cache` builds the model once), or a tmp folder when the cache plugin is off."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir(name) if cache is not None else tmp_path / "cache"


def assert_training_learns(config: str, cache_dir: Path, run_dir: Path, split_key: str, min_gain_se: float) -> None:
    """Build `config`'s run (its embedded model into `cache_dir`), evaluate it greedily on the held-out
    tasks, train, evaluate again, and assert the greedy success rose by more than `min_gain_se`
    standard errors of the difference (sqrt(se_before² + se_after²)). `split_key` names the task meta
    field that the split keeps apart: no held-out task shares its value with a training task. A start
    at 0 or 1 (standard error 0) is refused, as a gain measured from it would say little. The times of
    the build, the evaluations and the training are printed (`-s`), not asserted."""
    import math

    from tiderl.config import load_config
    from tiderl.evaluate import evaluate
    from tiderl.recipe import train
    from tiderl.run import build_run

    t0 = time.perf_counter()
    cfg = load_config(config, [f"model.cache_dir={cache_dir}", f"run_dir={run_dir}"])
    run = build_run(cfg)
    built = time.perf_counter()
    held_out = run.setup.eval_tasks
    assert len(held_out) == cfg.data.eval_size
    assert not {t.meta[split_key] for t in run.setup.train_tasks} & {t.meta[split_key] for t in held_out}

    def greedy() -> dict:
        return evaluate(run.engine, run.tokenizer, run.make_env, held_out, cfg.env, cfg.rollout, greedy=True)

    before = greedy()
    assert 0.0 < before["success"] < 1.0, before
    t_train = time.perf_counter()
    history, _ = train(run)
    t_after = time.perf_counter()
    after = greedy()
    end = time.perf_counter()
    assert len(history) == cfg.train.steps

    se = math.sqrt(before["stderr"] ** 2 + after["stderr"] ** 2)
    gain = after["success"] - before["success"]
    print(f"\nheld-out greedy success (n={after['n']}): {before['success']:.3f} ± {before['stderr']:.3f} -> "
          f"{after['success']:.3f} ± {after['stderr']:.3f}, gain {gain:+.3f} = {gain / se:.1f} SE; "
          f"build {built - t0:.0f} s, eval {t_train - built + end - t_after:.0f} s, train {t_after - t_train:.0f} s, "
          f"total {end - t0:.0f} s")
    assert gain > min_gain_se * se, (f"held-out success {before['success']:.3f} -> {after['success']:.3f}: a gain of "
                                     f"{gain:+.3f}, not above {min_gain_se} standard errors ({min_gain_se * se:.3f})")


def load_benchmark(name: str):
    """The module of `benchmarks/<name>.py` (its neighbour `common` importable, as when run)."""
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worst_behaviour_gap(trajectories: list[Trajectory], trainer_logprobs: torch.Tensor) -> tuple[float, int]:
    """(largest |behaviour - trainer| log-prob over the sampled tokens, how many were sampled):
    row i of `trainer_logprobs` is trajectory i's recompute."""
    worst, sampled = 0.0, 0
    for row, t in enumerate(trajectories):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        gap = torch.tensor(t.behavior_logprobs)[mask] - trainer_logprobs[row, :len(t.tokens)][mask]
        worst, sampled = max(worst, float(gap.abs().max())), sampled + int(mask.sum())
    return worst, sampled
