"""Task setups: the tasks a run trains and evaluates on, and the environment they run in.

`load_setup(data)` reads `data.source`:

| source | train tasks | eval tasks | environment |
| --- | --- | --- | --- |
| `embedded` | generated questions on a synthetic movie KG | the same, on held-out topic entities | KG, in-memory store |
| `metaqa` | tiderl's template questions over MetaQA's kb.txt | MetaQA's real test questions (`data.hops`: 1, 2, 3) | KG, in-memory store |
| `agentbench_db` | the other dbbench split | dbbench `data.split` (`dev`, or `standard`) | DB (`env.db_backend`) |
| `agentbench_kg` | `kg_rl_all` minus the eval questions | AgentBench KG `data.split` (`dev`, `std`) | KG over `env.sparql_endpoint` (Freebase) |

AgentBench's DB task has no training split: an `agentbench_db` setup trains on the split it
does not evaluate on (`standard` when evaluating on `dev` and the reverse), so train and eval
tasks never overlap. AgentBench's KG `kg_rl_all` file repeats 13 of the 20 `dev` questions;
they are dropped from the training tasks.

Every source keeps at most `data.eval_size` eval tasks (a fixed-seed sample in file order when
there are more); `env_factory(env, setup)` makes one fresh environment per episode.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tiderl.config import DataConfig, EnvConfig
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.store import TripleStore, load_metaqa_kb
from tiderl.envs.kg.tasks import (
    build_movie_world,
    generate_metaqa_training_questions,
    generate_questions,
    load_metaqa_questions,
    split_by_entity,
)
from tiderl.envs.kg.tools import ObservationLimits
from tiderl.envs.protocol import Env, Task

METAQA_ATTRIBUTES = ("release_year", "has_imdb_rating", "has_imdb_votes")

# The hop counts tiderl's own question templates cover (training questions); MetaQA's test
# files also have 3-hop questions, which are evaluated but not generated.
TEMPLATE_HOPS = (1, 2)

DB_SPLITS = ("dev", "standard")
KG_EVAL_SPLITS = {"dev": "dev", "std": "std", "test": "std"}


@dataclass
class Setup:
    """The tasks to train on, the held-out tasks to evaluate on, and what their environment
    needs.

    store: the knowledge graph of `embedded` and `metaqa` setups; None for `agentbench_db`
        (every task carries its own tables) and `agentbench_kg` (the graph is behind
        `env.sparql_endpoint`).
    name: the data source. env_name: "kg" or "db", the environment the tasks need.
    split: the eval split of AgentBench sources ("" for the others).
    """

    store: TripleStore | None
    train_tasks: list[Task]
    eval_tasks: list[Task]
    name: str
    env_name: str = "kg"
    split: str = ""
    # Backends shared by every environment `env_factory` makes for this setup, built on first
    # use (a DB backend holds the task databases and the gold hashes; a SPARQL backend its
    # caches), keyed by what configures them.
    backends: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)


# The name the KG-only version had; every setup is a Setup.
KGSetup = Setup


def data_root(cfg: DataConfig) -> Path:
    """`data.data_dir`, else $TIDERL_DATA_DIR, else ../shared/data next to the repository."""
    if cfg.data_dir:
        return Path(cfg.data_dir)
    if os.environ.get("TIDERL_DATA_DIR"):
        return Path(os.environ["TIDERL_DATA_DIR"])
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _sample(tasks: list[Task], size: int, seed: int) -> list[Task]:
    """At most `size` tasks: a fixed-seed sample kept in the original order."""
    if len(tasks) <= size:
        return tasks
    keep = sorted(random.Random(seed).sample(range(len(tasks)), size))
    return [tasks[i] for i in keep]


def load_setup(cfg: DataConfig) -> Setup:
    """Build the task setup `data.source` names (see the module docstring). Deterministic for
    `data.seed`. Raises FileNotFoundError naming `data.data_dir` when the data is missing, and
    ValueError for an unknown source or split."""
    if cfg.source == "embedded":
        store = build_movie_world(cfg.seed, num_films=cfg.num_films, num_people=cfg.num_people)
        tasks = generate_questions(store, cfg.seed, hops=tuple(cfg.hops))
        train, held_out = split_by_entity(tasks, cfg.eval_fraction, cfg.seed)
        # A fixed-seed sample, kept in the original order (hops stay mixed).
        return Setup(store, train, _sample(held_out, cfg.eval_size, cfg.seed), "embedded")
    if cfg.source == "metaqa":
        return _metaqa_setup(cfg)
    if cfg.source == "agentbench_db":
        return _agentbench_db_setup(cfg)
    if cfg.source == "agentbench_kg":
        return _agentbench_kg_setup(cfg)
    raise ValueError(f"data.source {cfg.source!r} is not 'embedded', 'metaqa', 'agentbench_db' or "
                     "'agentbench_kg'")


# Kept for its callers (the RL loop, the embedded model, the tests): the same function.
load_kg_setup = load_setup


def _metaqa_setup(cfg: DataConfig) -> Setup:
    root = data_root(cfg) / "metaqa"
    if not (root / "kb.txt").is_file():
        raise FileNotFoundError(
            f"MetaQA not found at {root} (no kb.txt). Fix: set data.data_dir to the folder "
            "that holds metaqa/, or the TIDERL_DATA_DIR environment variable."
        )
    store = load_metaqa_kb(root / "kb.txt", attribute_relations=METAQA_ATTRIBUTES)
    # An equal fixed-seed sample of MetaQA's real test questions per hop count.
    per_hop = max(1, cfg.eval_size // len(cfg.hops))
    held_out = [task for hops in cfg.hops
                for task in load_metaqa_questions(root, hops=hops, split="test",
                                                  sample=per_hop, seed=cfg.seed)]
    topics = {t.meta["topic"] for t in held_out}
    train_hops = tuple(h for h in cfg.hops if h in TEMPLATE_HOPS)
    train: list[Task] = []
    if train_hops:  # data.hops=[3] evaluates 3-hop questions and has nothing to train on
        train = generate_metaqa_training_questions(
            store, cfg.seed, cfg.num_train_tasks, hops=train_hops, exclude_topics=topics)
    return Setup(store, train, held_out, "metaqa")


def _agentbench_db_setup(cfg: DataConfig) -> Setup:
    from tiderl.envs.db.tasks import DBBENCH_DIR, dbbench_dir, load_dbbench_tasks

    split = cfg.split or "dev"
    if split not in DB_SPLITS:
        raise ValueError(f"data.split {split!r} is not an AgentBench DB split. Fix: use one of "
                         f"{', '.join(DB_SPLITS)} (or '' for dev).")
    folder = dbbench_dir(data_root(cfg))
    if not (folder / f"{split}.jsonl").is_file():
        raise FileNotFoundError(
            f"AgentBench DB data not found at {folder} (no {split}.jsonl). Fix: set data.data_dir "
            f"to the folder that holds {DBBENCH_DIR}/, or the TIDERL_DATA_DIR environment variable."
        )
    held_out = _sample(load_dbbench_tasks(folder, split), cfg.eval_size, cfg.seed)
    other = next(s for s in DB_SPLITS if s != split)
    train = load_dbbench_tasks(folder, other) if (folder / f"{other}.jsonl").is_file() else []
    return Setup(None, train, held_out, "agentbench_db", env_name="db", split=split)


def _agentbench_kg_setup(cfg: DataConfig) -> Setup:
    from tiderl.envs.kg.agentbench import load_agentbench_kg_tasks

    split = cfg.split or "dev"
    if split not in KG_EVAL_SPLITS:
        raise ValueError(f"data.split {split!r} is not an AgentBench KG eval split. Fix: use dev or std "
                         "(alias test), or '' for dev; kg_rl_all is the training split.")
    try:
        held_out = load_agentbench_kg_tasks(data_root(cfg), KG_EVAL_SPLITS[split])
        train_all = load_agentbench_kg_tasks(data_root(cfg), "kg_rl_all")
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{exc}. Fix: set data.data_dir to the folder that holds agentbench_kg/, or the "
            "TIDERL_DATA_DIR environment variable.") from None
    held_out = _sample(held_out, cfg.eval_size, cfg.seed)
    seen = {t.meta.get("qid") for t in held_out} | {t.prompt for t in held_out}
    train = [t for t in train_all if t.meta.get("qid") not in seen and t.prompt not in seen]
    return Setup(None, train, held_out, "agentbench_kg", split=KG_EVAL_SPLITS[split])


def kg_backend(env: EnvConfig, setup: Setup) -> Any:
    """The graph the KG tools read: the setup's store, or for `agentbench_kg` a SPARQL backend
    on `env.sparql_endpoint` with the Freebase schema (built once per setup and endpoint;
    building it sends no query)."""
    if setup.name == "agentbench_kg":
        if not env.sparql_endpoint:
            raise ValueError("data.source=agentbench_kg needs a Freebase SPARQL endpoint. Fix: set "
                             "env.sparql_endpoint=http://host:port/sparql")
        key = ("sparql", env.sparql_endpoint)
        if key not in setup.backends:
            from tiderl.envs.kg.rdf import FREEBASE
            from tiderl.envs.kg.sparql import sparql_backend

            setup.backends[key] = sparql_backend(env.sparql_endpoint, FREEBASE)
        return setup.backends[key]
    if env.sparql_endpoint:
        raise ValueError(f"env.sparql_endpoint is used with data.source=agentbench_kg (Freebase), not with "
                         f"{setup.name!r}, whose graph is in memory. Fix: set env.sparql_endpoint=''")
    if setup.store is None:
        raise ValueError(f"the {setup.name!r} setup has no knowledge graph: it needs env.name=db")
    return setup.store


def db_backend(env: EnvConfig, setup: Setup) -> Any:
    """The database backend `env.db_backend` names (sqlite, duckdb or a SQLAlchemy URL), built
    once per setup: every episode's database and every gold hash live in it."""
    key = ("db", env.db_backend)
    if key not in setup.backends:
        from tiderl.envs.db.env import make_backend

        setup.backends[key] = make_backend(env.db_backend)
    return setup.backends[key]


def env_factory(env: EnvConfig, setup: Setup) -> Callable[[], Env]:
    """A function that creates one fresh environment per episode, as `env` configures it.

    env.name=kg: `KGEnv` on `kg_backend` with `max_listed`, the system prompt and
    `ObservationLimits(max_items, max_observation_chars)`. env.name=db: `DBEnv` on `db_backend`
    with `Limits(max_rows=max_items, timeout_s=db_timeout_s,
    max_observation_chars=max_observation_chars)`. Raises ValueError when `env.name` does not
    fit the setup's tasks.
    """
    system_prompt = env.system_prompt or None
    if env.name != setup.env_name:
        raise ValueError(f"env.name={env.name!r} cannot run the tasks of data.source={setup.name!r}, "
                         f"which need env.name={setup.env_name!r}. Fix: set env.name={setup.env_name}")
    if env.name == "db":
        from tiderl.envs.db.env import DBEnv
        from tiderl.envs.db.tools import Limits

        backend = db_backend(env, setup)
        limits = Limits(max_rows=env.max_items, timeout_s=env.db_timeout_s,
                        max_observation_chars=env.max_observation_chars)
        return lambda: DBEnv(backend, limits=limits, system_prompt=system_prompt)
    store, max_listed = kg_backend(env, setup), env.max_listed
    limits = ObservationLimits(max_items=env.max_items, max_chars=env.max_observation_chars)
    return lambda: KGEnv(store, max_listed=max_listed, system_prompt=system_prompt, limits=limits)
