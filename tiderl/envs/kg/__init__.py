"""Knowledge-graph environment: triple store, AgentBench-style tools, env and task sources."""

from tiderl.envs.kg.env import TOOL_SCHEMAS, KGEnv, set_scores
from tiderl.envs.kg.store import (
    METAQA_ATTRIBUTE_RELATIONS,
    TripleStore,
    inverse,
    load_metaqa_kb,
    load_tsv_triples,
)
from tiderl.envs.kg.tasks import (
    build_movie_world,
    default_templates,
    follow_path,
    generate_metaqa_training_questions,
    generate_questions,
    load_metaqa_questions,
    oracle_relation_path,
    oracle_turns,
    path_answer,
    qtype_to_path,
    split_by_entity,
    tool_call_text,
)
from tiderl.envs.kg.tools import TOOL_ARGUMENTS, KGToolbox

__all__ = [
    "KGEnv",
    "KGToolbox",
    "METAQA_ATTRIBUTE_RELATIONS",
    "TOOL_ARGUMENTS",
    "TOOL_SCHEMAS",
    "TripleStore",
    "build_movie_world",
    "default_templates",
    "follow_path",
    "generate_metaqa_training_questions",
    "generate_questions",
    "inverse",
    "load_metaqa_kb",
    "load_metaqa_questions",
    "load_tsv_triples",
    "oracle_relation_path",
    "oracle_turns",
    "path_answer",
    "qtype_to_path",
    "set_scores",
    "split_by_entity",
    "tool_call_text",
]
