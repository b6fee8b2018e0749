"""Task setups: the knowledge graph plus the train and held-out tasks a run uses."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
from tiderl.envs.protocol import Task

METAQA_ATTRIBUTES = ("release_year", "has_imdb_rating", "has_imdb_votes")


@dataclass
class KGSetup:
    """A knowledge graph, the tasks to train on and the held-out tasks to evaluate on."""

    store: TripleStore
    train_tasks: list[Task]
    eval_tasks: list[Task]
    name: str


def data_root(cfg: DataConfig) -> Path:
    """`data.data_dir`, else $TIDERL_DATA_DIR, else ../shared/data next to the repository."""
    if cfg.data_dir:
        return Path(cfg.data_dir)
    if os.environ.get("TIDERL_DATA_DIR"):
        return Path(os.environ["TIDERL_DATA_DIR"])
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def load_kg_setup(cfg: DataConfig) -> KGSetup:
    """Build the task setup `data.source` names. Deterministic for `data.seed`."""
    if cfg.source == "embedded":
        store = build_movie_world(cfg.seed, num_films=cfg.num_films, num_people=cfg.num_people)
        tasks = generate_questions(store, cfg.seed, hops=tuple(cfg.hops))
        train, held_out = split_by_entity(tasks, cfg.eval_fraction, cfg.seed)
        if len(held_out) > cfg.eval_size:
            # A fixed-seed sample, kept in the original order (hops stay mixed).
            keep = sorted(random.Random(cfg.seed).sample(range(len(held_out)), cfg.eval_size))
            held_out = [held_out[i] for i in keep]
        return KGSetup(store, train, held_out, "embedded")
    if cfg.source == "metaqa":
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
        train = generate_metaqa_training_questions(
            store, cfg.seed, cfg.num_train_tasks, hops=tuple(cfg.hops), exclude_topics=topics)
        return KGSetup(store, train, held_out, "metaqa")
    raise ValueError(f"data.source {cfg.source!r} is not 'embedded' or 'metaqa'")


def env_factory(env: EnvConfig, setup: KGSetup) -> Callable[[], KGEnv]:
    """A function that creates one fresh environment per episode, as `env` configures it."""
    store, max_listed = setup.store, env.max_listed
    system_prompt = env.system_prompt or None
    return lambda: KGEnv(store, max_listed=max_listed, system_prompt=system_prompt)
