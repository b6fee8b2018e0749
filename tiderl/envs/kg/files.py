"""Your own knowledge-graph questions (`data.train_files`, `data.eval_files`), asked of the
graph of `data.source` (the generated movie world, or MetaQA's kb.txt).

Two shapes of file:

* MetaQA's: `.txt` or `.tsv` lines `question with [topic]<TAB>answer|answer` (the topic entity
  in brackets, answers separated by `|`), as MetaQA's `qa_*.txt` files are;
* records (JSON Lines, Parquet, a saved `datasets` folder: `tiderl.envs.setup.read_records`)
  with a question, its answers (a list, or one string with `|` between answers) and optionally
  the topic entity (else the bracketed one of the question), the relation path that solves it
  (for the oracle and `by_hops` tables) and an id; `data.fields` names other fields.

Every topic, answer and relation must be in the graph: a question whose answer the graph cannot
give would never be rewarded, so it is an error naming the file, the record and the fix. The
topic is left out of the predicted and listed answers (MetaQA's convention, `exclude_topic`)
when the question has two or more hops, or, with no path given, when the topic is not itself
one of the answers.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from tiderl.envs.kg.store import TripleStore
from tiderl.envs.protocol import Task
from tiderl.envs.setup import field_names, read_records, record_field

FIELD_NAMES = {"question": ("question",), "answer": ("answers", "answer"), "topic": ("topic", "topic_entity"),
               "path": ("path", "relations"), "id": ("id", "qid", "task_id")}
FIELDS_EXAMPLE = "{question: q, answer: gold, topic: entity}"
METAQA_SUFFIXES = (".txt", ".tsv")
_TOPIC = re.compile(r"\[([^\]]+)\]")


def file_tasks(paths: list[Path], fields: dict[str, str], store: TripleStore) -> list[Task]:
    """The KG tasks of `paths` (module docstring), checked against `store`. Task ids are
    `<folder>/<file stem>-<id>` (the record's id, else its index)."""
    names = field_names(FIELD_NAMES, fields)
    tasks = []
    for path in paths:
        for i, record in enumerate(_records(path)):
            where = f"{path}: record {i + 1}" if path.suffix not in METAQA_SUFFIXES else f"{path}:{record['line']}"
            key = next((record[n] for n in names["id"] if record.get(n) not in (None, "")), i)
            task = _task(record, names, where, store)
            task.meta["file"] = str(path)
            tasks.append(dataclasses.replace(task, task_id=f"{path.parent.name}/{path.stem}-{key}"))
    return tasks


def _records(path: Path) -> list[dict[str, Any]]:
    """A MetaQA file's lines as records (question, answers, line number), or `read_records`."""
    if path.suffix not in METAQA_SUFFIXES:
        return read_records(path)
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'question with [topic]<TAB>answer|answer', got {line!r}. "
                             "Fix: one question a line, a tab, then its answers separated by |")
        records.append({"question": parts[0].strip(), "answers": parts[1].strip(), "line": number})
    return records


def _task(record: dict[str, Any], names: dict[str, tuple[str, ...]], where: str, store: TripleStore) -> Task:
    question = str(record_field(record, names["question"], where, FIELDS_EXAMPLE))
    answers = record_field(record, names["answer"], where, FIELDS_EXAMPLE)
    answers = [a.strip() for a in answers.split("|")] if isinstance(answers, str) else [str(a) for a in answers]
    answers = sorted({a for a in answers if a})
    topic = next((str(record[n]) for n in names["topic"] if record.get(n)), None)
    if topic is None:
        match = _TOPIC.search(question)
        if match is None:
            raise ValueError(f"{where}: no topic entity: no {' or '.join(names['topic'])} field and no [entity] in "
                             f"the question {question!r}. Fix: mark it [like this] in the question, or name the field "
                             f"in data.fields, e.g. {FIELDS_EXAMPLE}")
        topic = match.group(1)
    unknown = [e for e in [topic, *answers] if not store.has_entity(e)]
    if not answers or unknown:
        what = f"entities {unknown} are" if unknown else "it has no answer, which is"
        raise ValueError(f"{where}: {what} not in the graph of this data.source, so the question can never be "
                         "answered. Fix: ask about the graph's entities (`tiderl eval --oracle` shows the graph's "
                         "questions), or pick the data.source whose graph the file was written for")
    meta: dict[str, Any] = {"topic": topic}
    relations = next((record[n] for n in names["path"] if record.get(n)), None)
    if relations is not None:
        relations = [relations] if isinstance(relations, str) else [str(r) for r in relations]
        missing = [r for r in relations if r not in set(store.relation_names())]
        if missing:
            raise ValueError(f"{where}: relations {missing} are not in the graph. Fix: use its relations "
                             f"({', '.join(store.relation_names()[:8])}, ...), or leave the path out")
        meta |= {"path": relations, "hops": len(relations)}
    meta["exclude_topic"] = meta["hops"] >= 2 if "hops" in meta else topic not in answers
    return Task("", question, answers, meta)
