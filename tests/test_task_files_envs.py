"""Your own task files for the code and knowledge-graph environments (`data.train_files`,
`data.eval_files`, `data.fields`), and a `datasets` folder saved to disk as a third format of
every environment's task files. Small files written in tmp_path: no shared data needed. The tasks
read are played: the oracle's (reference) answer is rewarded and a wrong one is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import block_import
from tiderl.config import load_config
from tiderl.envs.code.data import file_tasks as code_file_tasks
from tiderl.envs.protocol import Action, ToolCall
from tiderl.envs.setup import load_setup, read_records, task_files

MBPP = {"task_id": 601, "text": "Write a function to find the  larger of two numbers.",
        "code": "def bigger(a, b):\n    return a if a > b else b\n",
        "test_list": ["assert bigger(1, 2) == 2", "assert bigger(5, -1) == 5", "assert bigger(3, 3) == 3"]}
HUMANEVAL = {"task_id": "Mine/0", "entry_point": "double",
             "prompt": 'def double(x):\n    """Twice x.\n    >>> double(2)\n    4\n    """\n',
             "canonical_solution": "    return 2 * x\n",
             "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == -6\n"}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_dataset(folder: Path, records: list[dict], shards: int = 2) -> Path:
    """A folder laid out as `datasets`' Dataset.save_to_disk writes it (Arrow IPC stream shards
    listed in state.json), written with pyarrow alone."""
    pa = pytest.importorskip("pyarrow", reason="saved datasets are read with pyarrow (pip install 'tiderl[data]')")
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(records) // shards)
    for i, name in enumerate(names):
        table = pa.Table.from_pylist(records[i * per:(i + 1) * per], schema=pa.Table.from_pylist(records).schema)
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


# -- a saved datasets folder --------------------------------------------------------------------------


def test_a_saved_dataset_folder_reads_as_its_jsonl(tmp_path):
    records = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}", "id": i} for i in range(5)]
    folder = save_dataset(tmp_path / "saved", records)
    assert task_files([str(folder)]) == [folder]
    assert read_records(folder) == records  # both shards, in state.json's order
    cfg = load_config(None, ["env.name=math", f"data.train_files=[{folder}]",
                             f"data.eval_files=[{write_jsonl(tmp_path / 'test.jsonl', records[:2])}]"])
    setup = load_setup(cfg)
    assert [(t.prompt, t.answer) for t in setup.train_tasks] == [(f"{i} + 1?", str(i + 1)) for i in range(5)]
    assert setup.train_tasks[0].task_id == f"{tmp_path.name}/saved-0"


def test_folders_that_are_not_one_saved_split_are_refused_with_the_fix(tmp_path):
    whole = tmp_path / "gsm"
    save_dataset(whole / "train", [{"question": "q", "answer": "1"}])
    (whole / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"saved DatasetDict \(splits train, test\).*Fix: .*gsm/train"):
        task_files([str(whole)])
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"without state.json.*Fix: name a JSON Lines or Parquet file"):
        task_files([str(tmp_path / "plain")])


def test_a_saved_dataset_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    block_import(monkeypatch, "pyarrow")
    with pytest.raises(ImportError, match=r"reading a saved dataset needs pyarrow. Fix: pip install 'tiderl\[data\]'"):
        read_records(folder)


# -- code: MBPP and HumanEval records ------------------------------------------------------------------


def submit(setup, task, code: str) -> float:
    env = setup.make_env()
    env.reset(task)
    return env.step(Action("", [ToolCall("submit", {"code": code})])).reward


def test_mbpp_and_humaneval_records_train_and_evaluate_the_code_env(tmp_path):
    train = write_jsonl(tmp_path / "mine" / "train.jsonl", [MBPP, {**MBPP, "task_id": 602, "text": None,
                                                                   "prompt": "Sanitized MBPP's field."}])
    held_out = write_jsonl(tmp_path / "mine" / "test.jsonl", [HUMANEVAL])
    setup = load_setup(load_config(None, ["env.name=code", f"data.train_files=[{train}]",
                                          f"data.eval_files=[{held_out}]"]))
    assert setup.name == "mine/train (held out: mine/test)" and [t.task_id for t in setup.train_tasks] == ["mine/train-601", "mine/train-602"]
    mbpp, humaneval = setup.train_tasks[0], setup.eval_tasks[0]
    assert mbpp.prompt.startswith("Write a function to find the larger of two numbers.\n")  # whitespace folded
    assert mbpp.meta["visible_tests"] == ["assert bigger(1, 2) == 2"] and mbpp.meta["entry_points"] == ["bigger"]
    assert setup.train_tasks[1].prompt.startswith("Sanitized MBPP's field.")
    assert humaneval.task_id == "mine/test-Mine/0" and humaneval.meta["entry_points"] == ["double"]
    assert humaneval.meta["visible_tests"] == ["assert double(2) == 4"]  # from the docstring, as for HumanEval
    # The hidden tests are the records' own: the reference passes them, a wrong answer does not.
    assert json.dumps(MBPP["code"]) in setup.oracle(mbpp)[0]  # the oracle submits the record's code
    assert submit(setup, mbpp, mbpp.meta["reference"]) == 1.0
    assert submit(setup, mbpp, "def bigger(a, b):\n    return a\n") == 0.0
    assert submit(setup, humaneval, humaneval.meta["reference"]) == 1.0
    assert submit(setup, humaneval, "def double(x):\n    return x + 2\n") == 0.0


def test_code_fields_map_other_names_and_tests_may_be_test_code(tmp_path):
    path = write_jsonl(tmp_path / "own.jsonl", [{"desc": "Add two numbers.", "checks": "assert add(1, 2) == 3\n"
                                                 "assert add(0, 0) == 0\n", "sol": "def add(a, b): return a + b"}])
    [task] = code_file_tasks([path], {"question": "desc", "tests": "checks", "reference": "sol"})
    assert task.meta["visible_tests"] == ["assert add(1, 2) == 3"] and task.meta["reference"].startswith("def add")
    assert "assert add(0, 0) == 0" in task.answer["tests"]
    cfg = load_config(None, ["env.name=code", "data.fields={question: desc, tests: checks}"])
    assert cfg.data.fields == {"question": "desc", "tests": "checks"}


@pytest.mark.parametrize("record, message", [
    ({"text": "no tests"}, r"record 1: no test_list or test or tests field. Fix: name the record's fields in data.fields"),
    ({"code": "x", "test_list": ["assert f(1) == 1"]}, r"record 1: no text or prompt or question field"),
    ({**MBPP, "test_list": ["assert f(1 == 1"]}, r"record 1: field test_list is not Python .*Fix:"),
    ({**MBPP, "test_list": ["print(1)"]}, r"record 1: item 1 of field test_list is not an assert statement.*Fix:"),
    ({**MBPP, "test_list": "print(1)"}, r"record 1: field test_list holds no assert statement.*Fix:"),
    ({**MBPP, "test_list": 7}, r"record 1: field test_list is a int; expected a list of assert statements"),
    ({**HUMANEVAL, "entry_point": "not a name"}, r"record 1: entry_point 'not a name' is not a function name. Fix:"),
    ({**HUMANEVAL, "test": "assert double(2) == 4"}, r"record 1: field test defines no check\(candidate\).*Fix:"),
])
def test_bad_code_records_name_the_record_the_field_and_the_fix(tmp_path, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(ValueError, match=message):
        code_file_tasks([path], {})


# -- knowledge graph: MetaQA-style lines and records, against the graph ----------------------------


@pytest.fixture(scope="module")
def world():
    """The embedded movie world of seed 0 and two of its questions (1 and 2 hops)."""
    setup = load_setup(load_config(None, ["env.name=kg", "data.eval_size=20"]))
    one = next(t for t in setup.train_tasks if t.meta["hops"] == 1)
    two = next(t for t in setup.train_tasks if t.meta["hops"] == 2)
    return setup, one, two


def play_kg(setup, task, turns: list[str]) -> float:
    from tiderl.agent.tool_parser import parse_hermes_tool_calls

    env = setup.make_env()
    env.reset(task)
    for turn in turns:
        result = env.step(parse_hermes_tool_calls(turn))
        if result.done:
            return result.reward
    return env.finish("max_turns").reward


def test_metaqa_lines_and_records_are_asked_of_the_sources_graph(tmp_path, world):
    _, one, two = world
    topic = one.meta["topic"]
    lines = tmp_path / "qa" / "qa_train.txt"
    lines.parent.mkdir()
    assert f"[{topic}]" in one.prompt  # the embedded questions mark their topic, as MetaQA's do
    lines.write_text(f"{one.prompt}\t{'|'.join(one.answer)}\n\n")
    records = write_jsonl(tmp_path / "qa" / "test.jsonl", [
        {"id": "q1", "question": two.prompt, "answers": two.answer, "topic": two.meta["topic"], "path": two.meta["path"]},
        {"question": f"again [{topic}]", "answers": "|".join(one.answer)},
    ])
    cfg = load_config(None, ["env.name=kg", f"data.train_files=[{lines}]", f"data.eval_files=[{records}]"])
    setup = load_setup(cfg)
    [trained] = setup.train_tasks
    assert trained.task_id == "qa/qa_train-0" and trained.answer == sorted(one.answer)
    assert trained.meta["topic"] == topic and trained.meta["exclude_topic"] is True and "path" not in trained.meta
    held = {t.task_id: t for t in setup.eval_tasks}
    assert set(held) == {"qa/test-q1", "qa/test-1"} and setup.name == "qa/qa_train (held out: qa/test)"
    assert held["qa/test-q1"].meta == {"topic": two.meta["topic"], "path": two.meta["path"], "hops": 2,
                                       "exclude_topic": True, "file": str(records)}
    # Played in the environment: the oracle's path is rewarded; the last turn naming the wrong variable is not.
    oracle = setup.oracle(held["qa/test-q1"])
    assert play_kg(setup, held["qa/test-q1"], oracle) == 1.0
    assert play_kg(setup, held["qa/test-q1"], [*oracle[:-1], "Final Answer: #0"]) == 0.0


def test_kg_questions_the_graph_cannot_answer_are_refused(tmp_path, world):
    setup, one, _ = world
    from tiderl.envs.kg.files import file_tasks

    def refused(record, message, suffix=".jsonl"):
        path = tmp_path / f"bad{suffix}"
        if suffix == ".jsonl":
            write_jsonl(path, [record])
        else:
            path.write_text(record)
        with pytest.raises(ValueError, match=message):
            file_tasks([path], {}, setup.store)

    topic = one.meta["topic"]
    refused({"question": "who?", "answers": one.answer}, r"record 1: no topic entity.*\[like this\]")
    refused({"question": f"[{topic}]?", "answers": ["nobody_42"]},
            r"record 1: entities \['nobody_42'\] are not in the graph of this data.source.*Fix:")
    refused({"question": f"[{topic}]?", "answers": one.answer, "path": ["no_such_relation"]},
            r"relations \['no_such_relation'\] are not in the graph. Fix:")
    refused({"question": f"[{topic}]?"}, r"no answers or answer field. Fix: name the record's fields in data.fields")
    refused(f"[{topic}] without a tab\n", r"bad.txt:1: expected 'question with \[topic\]<TAB>answer\|answer'", ".txt")
