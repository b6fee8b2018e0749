"""AgentBench's knowledge-graph questions as tiderl tasks, and their gold action traces.

AgentBench's KG records (`dev.json`, `std.json`, `kg_rl_all.json`) hold a question, the
entities it mentions (`name -> Freebase mid`), a gold tool-call trace such as
`get_neighbors(m.0zd6,computer.computer.includes_models)` (`#k` = the k-th variable created)
and the answer (mids, or the number a `count` returns). They need Freebase to run: the
records carry no intermediate results.

* `load_agentbench_kg_tasks`: the records as `Task`s for `KGEnv` (entity names usable as tool
  arguments through `meta["entities"]`, counts stored as variables so `Final Answer: #k` can
  name them).
* `gold_calls` / `gold_turns`: the trace as tool calls / as assistant turns in tiderl's
  Hermes format, ending with `Final Answer: #<last variable>`.
* `trace_graph`: a small synthetic graph, in Freebase's naming (mids, dotted relation ids),
  on which the gold trace reaches exactly the gold answer. It is built from the trace alone,
  so replaying on it checks parsing, variable numbering and the env's scoring, and that every
  backend runs the trace alike; it says nothing about Freebase's actual content.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Iterator, Sequence

from tiderl.envs.kg.rdf import XSD, GraphSpec
from tiderl.envs.kg.tasks import tool_call_text
from tiderl.envs.kg.tools import TOOL_ARGUMENTS, variable_number
from tiderl.envs.protocol import Task, ToolCall

# split name -> file; "test" and "train" are aliases (std.json is AgentBench's test set).
SPLITS = {"dev": "dev.json", "std": "std.json", "kg_rl_all": "kg_rl_all.json"}
_ALIASES = {"test": "std", "train": "kg_rl_all"}

# Tools whose result is a new variable (count too: AgentBench tasks store counts, see module doc).
_CREATES_VARIABLE = ("get_neighbors", "intersection", "argmax", "argmin", "count")

_ACTION = re.compile(r"\s*(\w+)\((.*)\)\s*", re.S)


def agentbench_kg_dir(data_dir: str | Path) -> Path:
    """The folder holding the split files: `data_dir` itself, or its `agentbench_kg/`."""
    root = Path(data_dir)
    for folder in (root, root / "agentbench_kg"):
        if (folder / SPLITS["dev"]).is_file() or (folder / SPLITS["std"]).is_file():
            return folder
    raise FileNotFoundError(f"AgentBench KG data not found in {root} or {root / 'agentbench_kg'}: point "
                            "data_dir at the folder holding dev.json / std.json / kg_rl_all.json")


def parse_action(text: str) -> ToolCall:
    """One gold action (`name(arg1,arg2)`) as a ToolCall with tiderl's argument names.

    Two-argument tools split at the last comma (relations, attributes and variables never hold
    one; entity arguments might). Raises ValueError naming the action when it does not parse.
    """
    match = _ACTION.fullmatch(text)
    if match is None or match.group(1) not in TOOL_ARGUMENTS:
        raise ValueError(f"gold action {text!r} is not name(arguments) with a tool among {list(TOOL_ARGUMENTS)}")
    name, inside = match.groups()
    names = TOOL_ARGUMENTS[name]
    values = inside.rsplit(",", 1) if len(names) == 2 else [inside]
    if len(values) != len(names) or not all(v.strip() for v in values):
        raise ValueError(f"gold action {text!r}: {name} takes {len(names)} arguments ({', '.join(names)})")
    return ToolCall(name, {n: v.strip() for n, v in zip(names, values)})


def _record_task(record: dict, split: str, index: int) -> Task:
    """One record as a Task (see `load_agentbench_kg_tasks`)."""
    entities: dict[str, str] = dict(record.get("entities") or {})
    answers = record.get("answer") or []
    names = ", ".join(f"[{name}]" for name in entities)
    prompt = record["question"] + (f"\nEntities: {names}" if names else "")
    return Task(
        task_id=f"agentbench-kg-{split}-{index}",
        prompt=prompt,
        answer=sorted({str(a["answer_argument"]) for a in answers}),
        meta={
            "qid": record.get("qid"), "source": record.get("source"), "entities": entities,
            "topic": next(iter(entities.values()), None), "exclude_topic": False,
            "actions": list(record.get("actions") or []), "s_expression": record.get("s_expression"),
            # Records without answer_type hold mids (argmax answers in kg_rl_all): entities.
            "answer_type": "Value" if any(a.get("answer_type") == "Value" for a in answers) else "Entity",
            "answer_names": {str(a["answer_argument"]): a["entity_name"] for a in answers if "entity_name" in a},
            "count_creates_variable": True,
        },
    )


def load_agentbench_kg_tasks(data_dir: str | Path, split: str) -> list[Task]:
    """The records of one split (`dev`, `std` = `test`, `kg_rl_all` = `train`) as Tasks.

    prompt: the question plus `Entities: [name], [name]`; answer: the sorted answer
    arguments (mids, or the count as a string); task ids `agentbench-kg-<split>-<index>`.
    meta: qid, source, entities (name -> mid, what lets the agent use the names), topic (the
    first entity's mid), actions (the gold trace), s_expression, answer_type, answer_names,
    count_creates_variable = True, exclude_topic = False.
    """
    split = _ALIASES.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"unknown AgentBench KG split {split!r}: use one of {sorted(SPLITS) + sorted(_ALIASES)}")
    path = agentbench_kg_dir(data_dir) / SPLITS[split]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the {split} split is missing from {path.parent}")
    records = json.loads(path.read_text(encoding="utf-8"))
    return [_record_task(record, split, i) for i, record in enumerate(records)]


def gold_calls(task: Task) -> list[ToolCall]:
    """The task's gold trace (`meta["actions"]`) as ToolCalls."""
    return [parse_action(a) for a in task.meta.get("actions", [])]


def created_variables(calls: Sequence[ToolCall]) -> list[int | None]:
    """For each call, the number of the variable it creates (None for get_relations and
    get_attributes), in AgentBench's numbering: one counter over all creating calls."""
    counter = itertools.count()
    return [next(counter) if c.name in _CREATES_VARIABLE else None for c in calls]


def gold_turns(task: Task) -> list[str]:
    """Assistant turns replaying the gold trace, one tool call per turn (as AgentBench's agent
    acts), then `Final Answer: #<last variable created>`."""
    calls = gold_calls(task)
    made = [v for v in created_variables(calls) if v is not None]
    if not made:
        raise ValueError(f"task {task.task_id}: the gold trace creates no variable to answer with")
    return [tool_call_text(c.name, c.arguments) for c in calls] + [f"Final Answer: #{made[-1]}"]


def _variable(ref: str) -> int | None:
    return variable_number(ref)


def _fresh_mids() -> Iterator[str]:
    """Synthetic Freebase-style mids, unlike any real one (`m.0tdrl` + a counter)."""
    for n in itertools.count():
        yield f"m.0tdrl{n}"


def trace_graph(task: Task) -> GraphSpec:
    """A graph on which `gold_turns(task)` reaches exactly `task.answer` (see module doc).

    Built backwards from the answer: each variable gets the exact set of members the later
    calls need (fresh mids where nothing else is required); get_neighbors adds the edges that
    produce its set, from one member of its input variable; intersection and argmax/argmin add
    a distractor to each input so they really filter; attribute values are integers, or
    xsd:date for attributes named like dates. Labels: the task's entity names and answer names.
    Raises ValueError when the trace cannot be satisfied this way (e.g. an intersection with a
    named entity outside the answer).
    """
    calls = gold_calls(task)
    created = created_variables(calls)
    producers = {v: c for v, c in zip(created, calls) if v is not None}
    fresh = _fresh_mids()
    need: dict[int, set[str]] = {}
    graph = GraphSpec(labels={mid: name for name, mid in task.meta.get("entities", {}).items()})
    graph.labels.update(task.meta.get("answer_names", {}))

    last = calls[-1] if calls else None
    if last is not None and last.name == "count":
        counted = _variable(last.arguments["variable"])
        if counted is None:
            raise ValueError(f"task {task.task_id}: count of an entity name is always 1, not a trace to synthesise")
        need[counted] = {next(fresh) for _ in range(int(task.answer[0]))}
    elif created and created[-1] is not None:
        need[created[-1]] = set(task.answer)

    def require(ref: str, members: set[str]) -> None:
        """`ref` (a variable, or an entity) must contain `members`."""
        v = _variable(ref)
        if v is not None:
            need.setdefault(v, set()).update(members)
        elif not members <= {ref}:
            raise ValueError(f"task {task.task_id}: entity {ref} would have to contain {sorted(members)}")

    def members(v: int) -> set[str]:
        """The members variable `v` must have; one fresh mid when nothing constrains it yet
        (every variable must be non-empty for the calls on it to succeed)."""
        if v not in need:
            need[v] = {next(fresh)}
        return need[v]

    def same_producer(a: str, b: str) -> bool:
        va, vb = _variable(a), _variable(b)
        return va is not None and vb is not None and producers[va] == producers[vb]

    for call, v in reversed(list(zip(calls, created))):
        if v is None or call.name == "count":
            continue
        target = members(v)
        args = call.arguments
        if call.name == "get_neighbors":
            source = _variable(args["variable"])
            carrier = args["variable"] if source is None else min(members(source))
            graph.edges += [(carrier, args["relation"], t) for t in sorted(target)]
        elif call.name == "intersection":
            # Two identical calls make identical sets: a distractor in one would be in both.
            twins = same_producer(args["variable1"], args["variable2"])
            for side in (args["variable1"], args["variable2"]):
                require(side, set(target) | (set() if twins or _variable(side) is None else {next(fresh)}))
        else:  # argmax / argmin
            loser = next(fresh)
            require(args["variable"], set(target) | ({loser} if _variable(args["variable"]) is not None else set()))
            high, low, datatype = (("2005-06-01", "1999-01-01", XSD + "date") if "date" in args["attribute"]
                                   else ("2005", "1999", XSD + "integer"))
            best, worst = (high, low) if call.name == "argmax" else (low, high)
            graph.values += [(t, args["attribute"], best, datatype) for t in sorted(target)]
            if _variable(args["variable"]) is not None:
                graph.values.append((loser, args["attribute"], worst, datatype))
    return graph
