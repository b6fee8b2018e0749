"""The knowledge-graph environment's setups, one per `data.source`:

| source | train tasks | eval tasks | graph |
| --- | --- | --- | --- |
| `embedded` | generated questions on a synthetic movie KG | the same, on held-out topic entities | in memory |
| `metaqa` | tiderl's template questions over MetaQA's kb.txt | MetaQA's real test questions (`env.options.hops`: 1, 2, 3) | in memory |
| `agentbench_kg` | `kg_rl_all` minus the eval questions | AgentBench KG `data.split` (`dev`, `std`) | `env.options.sparql_endpoint` (Freebase) |

AgentBench's KG `kg_rl_all` file repeats 13 of the 20 `dev` questions; they are dropped from the
training tasks. Every source keeps at most `data.eval_size` eval tasks (a fixed-seed sample).
The options (`env.options.*`) are `tiderl.envs.kg.registration.KGOptions`.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.store import load_metaqa_kb
from tiderl.envs.kg.tasks import (
    build_movie_world,
    generate_metaqa_training_questions,
    generate_questions,
    load_metaqa_questions,
    oracle_turns,
    split_by_entity,
)
from tiderl.envs.kg.tools import ObservationLimits
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, data_root, file_split, files_name, sample_tasks

if TYPE_CHECKING:
    from tiderl.config import RunConfig

METAQA_ATTRIBUTES = ("release_year", "has_imdb_rating", "has_imdb_votes")

# The hop counts tiderl's own question templates cover (training questions); MetaQA's test
# files also have 3-hop questions, which are evaluated but not generated.
TEMPLATE_HOPS = (1, 2)

KG_EVAL_SPLITS = {"dev": "dev", "std": "std", "test": "std"}


def setup(cfg: "RunConfig") -> Setup:
    """The tasks of `data.source` and a factory of `KGEnv`s over its graph, configured by `env`
    (`options.max_listed`, the system prompt, `ObservationLimits(max_items, max_observation_chars)`)."""
    data, options = cfg.data, cfg.env.options
    if data.source == "embedded":
        store = build_movie_world(data.seed, num_films=options.num_films, num_people=options.num_people)
        tasks = generate_questions(store, data.seed, hops=tuple(options.hops))
        train, held_out = split_by_entity(tasks, options.eval_fraction, data.seed)
        out = Setup(train, sample_tasks(held_out, data.eval_size, data.seed), _no_env, "embedded", store=store)
    elif data.source == "metaqa":
        out = _metaqa(cfg)
    elif data.source == "agentbench_kg":
        out = _agentbench_kg(cfg)
    else:
        raise ValueError(f"data.source={data.source!r} is not a knowledge-graph source. Fix: use embedded, "
                         "metaqa or agentbench_kg with env.name=kg.")
    _read_task_files(cfg, out)
    env, prompt = cfg.env, cfg.env.system_prompt or None
    limits = ObservationLimits(max_items=env.max_items, max_chars=env.max_observation_chars)
    out.make_env = _KGFactory(out, options.sparql_endpoint, options.max_listed, prompt, limits)
    out.oracle = oracle_turns_for
    if options.drift.every_steps > 0:
        _add_drift(cfg, out)
    return out


def _read_task_files(cfg: "RunConfig", out: Setup) -> None:
    """Replace the setup's training and/or held-out tasks by those of `data.train_files` /
    `data.eval_files` (`tiderl.envs.kg.files`), asked of the source's graph."""
    data = cfg.data
    train_files, eval_files = file_split(data)
    if not (train_files or eval_files):
        return
    if out.store is None:
        raise ValueError(f"data.train_files / data.eval_files ask questions of an in-memory graph; data.source="
                         f"{out.name} queries an endpoint. Fix: use data.source=embedded or metaqa with task files")
    from tiderl.envs.kg.files import file_tasks

    if train_files:
        out.train_tasks = file_tasks(train_files, data.fields, out.store)
        out.name = files_name(train_files, eval_files, out.name)
    if eval_files:
        out.eval_tasks = sample_tasks(file_tasks(eval_files, data.fields, out.store), data.eval_size, data.seed)


def _add_drift(cfg: "RunConfig", out: Setup) -> None:
    """Make the setup's world change every `env.options.drift.every_steps` steps (tiderl/envs/drift.py):
    its environments play in, and its oracle solves, the world of the current step."""
    from tiderl.envs.drift import DriftingKGFactory, DriftingWorld, DriftSchedule

    if out.store is None:
        raise ValueError(f"env.options.drift needs an in-memory graph; data.source={out.name} has none. Fix: use "
                         "data.source=embedded or metaqa, or env.options.drift.every_steps=0.")
    world = DriftingWorld(out.store, DriftSchedule.from_config(cfg.env.options.drift, cfg.data.seed))
    factory = out.make_env
    out.make_env = DriftingKGFactory(world, max_listed=factory.max_listed, system_prompt=factory.system_prompt,
                                     limits=factory.limits)
    out.oracle = lambda task: oracle_turns(world.current().answer(task), random.Random(0))
    out.on_step = world.at_step


def oracle_turns_for(task: Task) -> list[str]:
    """The scripted solution of a KG task: AgentBench's gold trace (`meta["actions"]`; a trace
    that creates no variable gives no turns, so the episode fails), or for MetaQA and embedded
    questions (`meta["path"]`) one `get_neighbors` per hop, then `Final Answer: #k`."""
    if "actions" in task.meta:
        from tiderl.envs.kg.agentbench import gold_turns

        try:
            return gold_turns(task)
        except ValueError:
            return []
    if "path" in task.meta:
        return oracle_turns(task, random.Random(0))
    raise ValueError(f"task {task.task_id}: no oracle for it (its meta has no 'actions' or 'path')")


def _no_env() -> KGEnv:
    raise RuntimeError("the setup's environment factory was not set")


class _KGFactory:
    """`make_env` of a KG setup: a `KGEnv` over the setup's graph (the SPARQL backend is built
    on first use, in the process that plays the episodes)."""

    def __init__(self, setup: Setup, endpoint: str, max_listed: int, system_prompt: str | None,
                 limits: ObservationLimits):
        self.setup, self.endpoint, self.max_listed = setup, endpoint, max_listed
        self.system_prompt, self.limits = system_prompt, limits

    def graph(self) -> Any:
        if self.setup.store is not None:
            if self.endpoint:
                raise ValueError(f"env.options.sparql_endpoint is used with data.source=agentbench_kg (Freebase), "
                                 f"not with {self.setup.name!r}, whose graph is in memory. Fix: set "
                                 "env.options.sparql_endpoint=''")
            return self.setup.store
        if not self.endpoint:
            raise ValueError(f"data.source={self.setup.name} needs a Freebase SPARQL endpoint. "
                             "Fix: set env.options.sparql_endpoint=http://host:port/sparql")

        def build() -> Any:
            from tiderl.envs.kg.rdf import FREEBASE
            from tiderl.envs.kg.sparql import sparql_backend

            return sparql_backend(self.endpoint, FREEBASE)

        return self.setup.backend(("sparql", self.endpoint), build)

    def __call__(self) -> KGEnv:
        return KGEnv(self.graph(), max_listed=self.max_listed, system_prompt=self.system_prompt,
                     limits=self.limits)


def _metaqa(cfg: "RunConfig") -> Setup:
    data, options = cfg.data, cfg.env.options
    root = data_root(data.data_dir) / "metaqa"
    if not (root / "kb.txt").is_file():
        raise FileNotFoundError(
            f"MetaQA not found at {root} (no kb.txt). Fix: set data.data_dir to the folder "
            "that holds metaqa/, or the TIDERL_DATA_DIR environment variable.")
    store = load_metaqa_kb(root / "kb.txt", attribute_relations=METAQA_ATTRIBUTES)
    # An equal fixed-seed sample of MetaQA's real test questions per hop count.
    per_hop = max(1, data.eval_size // len(options.hops))
    held_out = [task for hops in options.hops
                for task in load_metaqa_questions(root, hops=hops, split="test", sample=per_hop, seed=data.seed)]
    topics = {t.meta["topic"] for t in held_out}
    train_hops = tuple(h for h in options.hops if h in TEMPLATE_HOPS)
    train: list[Task] = []
    if train_hops:  # hops=[3] evaluates 3-hop questions and has nothing to train on
        train = generate_metaqa_training_questions(
            store, data.seed, options.num_train_tasks, hops=train_hops, exclude_topics=topics)
    return Setup(train, held_out, _no_env, "metaqa", store=store)


def _agentbench_kg(cfg: "RunConfig") -> Setup:
    from tiderl.envs.kg.agentbench import load_agentbench_kg_tasks

    data = cfg.data
    split = data.split or "dev"
    if split not in KG_EVAL_SPLITS:
        raise ValueError(f"data.split {split!r} is not an AgentBench KG eval split. Fix: use dev or std "
                         "(alias test), or '' for dev; kg_rl_all is the training split.")
    root = data_root(data.data_dir)
    try:
        held_out = load_agentbench_kg_tasks(root, KG_EVAL_SPLITS[split])
        train_all = load_agentbench_kg_tasks(root, "kg_rl_all")
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{exc}. Fix: set data.data_dir to the folder that holds agentbench_kg/, or the "
            "TIDERL_DATA_DIR environment variable.") from None
    held_out = sample_tasks(held_out, data.eval_size, data.seed)
    seen = {t.meta.get("qid") for t in held_out} | {t.prompt for t in held_out}
    train = [t for t in train_all if t.meta.get("qid") not in seen and t.prompt not in seen]
    return Setup(train, held_out, _no_env, "agentbench_kg", split=KG_EVAL_SPLITS[split])
