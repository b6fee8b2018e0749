"""Task sources for the KG environment: a synthetic movie world, MetaQA, and an oracle.

Three sources, each deterministic for a seed:

* `build_movie_world` + `generate_questions`: a small synthetic movie KG shaped like MetaQA
  (same relation names) with tiderl's own English question templates. Entity names are short
  and use few distinct characters so a tiny byte-level BPE model can copy them:
  films `film_042`, people `p_117`, genres `g_3`, languages `lang_1`, years `1987`.
* `load_metaqa_questions`: MetaQA's real questions, with the relation path read from the
  `qa_*_qtype.txt` files; `generate_metaqa_training_questions`: questions generated from
  MetaQA's kb.txt with tiderl's own templates, on topic entities disjoint from an eval set.
* `oracle_turns`: assistant turns that solve a task with `get_neighbors` calls, with optional
  relation noise, for warm-starting a tiny policy on imperfect demonstrations.

A question's relation path is a list of relations as the store names them; a `_inv` relation
walks an edge backwards (person -> film). Multi-hop answers exclude the topic entity (MetaQA's
convention), and every multi-hop task carries `meta["exclude_topic"] = True`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from tiderl.envs.kg.store import TripleStore, inverse
from tiderl.envs.protocol import Task

Templates = Mapping[tuple[str, ...], Sequence[str]]

# -- question phrasing tables (tiderl's own wording) ---------------------------------------
# "{topic}" is replaced by the bracketed topic entity, "{films}" by a plural film phrase.

# One film -> its <relation> (1 hop, forward).
_ASK_ABOUT_FILM: dict[str, tuple[str, ...]] = {
    "directed_by": ("who directed {topic}?", "who is the director of {topic}?", "{topic} was directed by whom?"),
    "written_by": ("who wrote {topic}?", "who is the writer of {topic}?", "who wrote the script of {topic}?"),
    "starred_actors": ("who acted in {topic}?", "who starred in {topic}?", "which actors appear in {topic}?"),
    "has_genre": ("what genre is {topic}?", "what kind of film is {topic}?", "which genres does {topic} have?"),
    "in_language": ("what language is {topic} in?", "in which language is {topic}?"),
    "release_year": ("when was {topic} released?", "in which year did {topic} come out?",
                     "what is the release year of {topic}?"),
    "has_tags": ("what is {topic} about?", "which tags describe {topic}?"),
}

# Several films -> their <relation> (the last hop of a 2-hop question).
_ASK_ABOUT_FILMS: dict[str, tuple[str, ...]] = {
    "directed_by": ("who directed {films}?", "who are the directors of {films}?"),
    "written_by": ("who wrote {films}?", "who are the writers of {films}?"),
    "starred_actors": ("who acted in {films}?", "which actors appear in {films}?"),
    "has_genre": ("what genres are {films}?", "which genres do {films} have?"),
    "in_language": ("what languages are {films} in?", "in which languages are {films}?"),
    "release_year": ("when were {films} released?", "in which years did {films} come out?"),
}

# Topic -> its films, as a noun phrase (the first hop of a 2-hop question, walked backwards).
_FILMS_OF: dict[str, tuple[str, ...]] = {
    "directed_by": ("the films directed by {topic}", "the movies {topic} directed"),
    "written_by": ("the films written by {topic}", "the movies {topic} wrote"),
    "starred_actors": ("the films starring {topic}", "the movies {topic} acted in"),
}

# Person -> the people sharing a film with them in the same role (2 hops: back, then forward);
# replaces the awkward composition "who directed the films directed by [p]?".
_ASK_PARTNERS: dict[str, tuple[str, ...]] = {
    "directed_by": ("who co-directed films with {topic}?", "which directors made a film together with {topic}?"),
    "written_by": ("who co-wrote films with {topic}?", "which writers wrote a film together with {topic}?"),
    "starred_actors": ("who acted together with {topic}?", "which actors appeared in films with {topic}?"),
}

# Topic -> its films (1 hop, backwards).
_ASK_FILMS_OF: dict[str, tuple[str, ...]] = {
    "directed_by": ("which films did {topic} direct?", "what movies were directed by {topic}?",
                    "{topic} directed which films?"),
    "written_by": ("which films did {topic} write?", "what movies were written by {topic}?"),
    "starred_actors": ("which films did {topic} act in?", "what movies star {topic}?",
                       "{topic} appears in which films?"),
    "release_year": ("which films were released in {topic}?", "what movies came out in {topic}?"),
    "has_tags": ("which films are about {topic}?", "what movies are tagged {topic}?"),
}

# One film -> the other films sharing a <relation> with it (2 hops: forward, then back).
_ASK_SHARING: dict[str, tuple[str, ...]] = {
    "directed_by": ("which films share a director with {topic}?",
                    "what other movies did the director of {topic} make?"),
    "written_by": ("which films share a writer with {topic}?",
                   "what else did the writer of {topic} write?"),
    "starred_actors": ("which films share an actor with {topic}?",
                       "what other movies feature the actors of {topic}?"),
}

# One film -> the films sharing a <relation> with it, as a noun phrase (the first two hops of a
# 3-hop question: forward, then back).
_FILMS_SHARING: dict[str, tuple[str, ...]] = {
    "directed_by": ("the films that share a director with {topic}",
                    "the other movies by the director of {topic}"),
    "written_by": ("the films that share a writer with {topic}",
                   "the other movies by the writer of {topic}"),
    "starred_actors": ("the films that share an actor with {topic}",
                       "the other movies with the actors of {topic}"),
}


def default_templates(relations: Iterable[str]) -> dict[tuple[str, ...], list[str]]:
    """Question phrasings for every 1-, 2- and 3-hop path the tables can word over `relations`
    (forward relation names; unknown ones are ignored). Keys are relation paths.

    3-hop paths are (r, r_inv, y): from a film, the other films sharing its r, then their y
    ("when were the films that share a director with [F] released?")."""
    rels = set(relations)
    templates: dict[tuple[str, ...], list[str]] = {}
    for r in sorted(rels & set(_ASK_ABOUT_FILM)):
        templates[(r,)] = list(_ASK_ABOUT_FILM[r])
    for r in sorted(rels & set(_ASK_FILMS_OF)):
        templates[(inverse(r),)] = list(_ASK_FILMS_OF[r])
    for x in sorted(rels & set(_FILMS_OF)):
        for y in sorted(rels & set(_ASK_ABOUT_FILMS)):
            templates[(inverse(x), y)] = (
                list(_ASK_PARTNERS[x]) if x == y else
                [ask.replace("{films}", films) for ask in _ASK_ABOUT_FILMS[y] for films in _FILMS_OF[x]]
            )
    for r in sorted(rels & set(_ASK_SHARING)):
        templates[(r, inverse(r))] = list(_ASK_SHARING[r])
    for r in sorted(rels & set(_FILMS_SHARING)):
        for y in sorted(rels & set(_ASK_ABOUT_FILMS)):
            if y != r:  # "who directed the films sharing a director with F" is 1-hop in disguise
                templates[(r, inverse(r), y)] = [
                    ask.replace("{films}", films) for ask in _ASK_ABOUT_FILMS[y] for films in _FILMS_SHARING[r]]
    return templates


def _forward_relations(store: TripleStore) -> list[str]:
    return [r for r in store.relation_names() if not r.endswith("_inv")]


def follow_path(store: TripleStore, topic: str, path: Sequence[str], hidden: Iterable[str] = ()) -> set[str]:
    """The entities reached from `topic` along `path` (the union over every branch), dropping
    `hidden` entities after every hop (as `KGToolbox` does)."""
    hidden = set(hidden)
    current = {topic}
    for relation in path:
        current = store.expand(current, relation) - hidden
    return current


def path_answer(store: TripleStore, topic: str, path: Sequence[str]) -> set[str]:
    """The gold answer of a question: `follow_path`, with the topic excluded at every hop of a
    multi-hop path (MetaQA's convention, which `KGEnv` applies for `exclude_topic` tasks)."""
    return follow_path(store, topic, path, hidden=[topic] if len(path) > 1 else [])


def _phrase(templates: Templates, path: tuple[str, ...], topic: str, seed: int) -> str:
    """Pick a phrasing for (path, topic), independent of which other questions are generated
    (a string-seeded Random is stable across runs and Python processes)."""
    choices = templates[path]
    if not choices:
        raise ValueError(f"templates for path {list(path)} are empty: give at least one phrasing")
    template = random.Random(f"{seed}|{'/'.join(path)}|{topic}").choice(list(choices))
    if "{topic}" not in template:
        raise ValueError(f"template {template!r} has no {{topic}} placeholder: add one")
    return template


def _make_task(task_id: str, template: str, topic: str, path: tuple[str, ...], answer: set[str]) -> Task:
    return Task(
        task_id=task_id,
        prompt=template.replace("{topic}", f"[{topic}]"),
        answer=sorted(answer),
        meta={"topic": topic, "path": list(path), "hops": len(path), "template": template,
              "exclude_topic": len(path) > 1},
    )


def _select_paths(templates: Templates, hops: Iterable[int]) -> list[tuple[str, ...]]:
    wanted = set(hops)
    paths = sorted((p for p in templates if len(p) in wanted), key=lambda p: (len(p), p))
    if not paths:
        raise ValueError(f"no question templates for hops={sorted(wanted)}: the templates cover "
                         f"hops {sorted({len(p) for p in templates})}")
    return paths


# -- the synthetic movie world -------------------------------------------------------------


def build_movie_world(
    seed: int = 0,
    num_films: int = 150,
    num_people: int = 120,
    num_genres: int = 8,
    num_languages: int = 5,
    years: tuple[int, int] = (1980, 2019),
) -> TripleStore:
    """A synthetic MetaQA-like movie KG, deterministic for `seed`.

    Every film has 1-2 directors, 1-2 writers (a quarter of films are written by their
    director alone), 2-3 actors, 1-2 genres, one language (lang_0 is the most common) and one
    release year (the store's only attribute relation). People are drawn uniformly for every
    role, so a person directs ~1.4 films and acts in ~3 on the defaults: answer sets stay small.
    """
    for name, value, least in (("num_films", num_films, 1), ("num_people", num_people, 3),
                               ("num_genres", num_genres, 2), ("num_languages", num_languages, 1)):
        if value < least:
            raise ValueError(f"build_movie_world: {name} must be >= {least}, got {value}")
    if years[0] > years[1]:
        raise ValueError(f"build_movie_world: years must be (first, last) with first <= last, got {years}")

    rng = random.Random(seed)
    films = [f"film_{i:03d}" for i in range(num_films)]
    people = [f"p_{i:03d}" for i in range(num_people)]
    genres = [f"g_{i}" for i in range(num_genres)]
    languages = [f"lang_{i}" for i in range(num_languages)]
    # lang_0 is five times as common as the others, like English in MetaQA.
    language_weights = [5.0] + [1.0] * (num_languages - 1)

    store = TripleStore(attribute_relations={"release_year"})
    for film in films:
        directors = rng.sample(people, 1 if rng.random() < 0.85 else 2)
        if rng.random() < 0.25:
            writers = directors[:1]
        else:
            writers = rng.sample(people, 1 if rng.random() < 0.8 else 2)
        actors = rng.sample(people, 2 if rng.random() < 0.6 else 3)
        for person in directors:
            store.add(film, "directed_by", person)
        for person in writers:
            store.add(film, "written_by", person)
        for person in actors:
            store.add(film, "starred_actors", person)
        for genre in rng.sample(genres, 1 if rng.random() < 0.6 else 2):
            store.add(film, "has_genre", genre)
        store.add(film, "in_language", rng.choices(languages, weights=language_weights)[0])
        store.add(film, "release_year", str(rng.randint(years[0], years[1])))
    return store


def generate_questions(
    store: TripleStore,
    seed: int = 0,
    hops: Iterable[int] = (1, 2),
    templates: Templates | None = None,
    max_answers: int = 5,
) -> list[Task]:
    """Every answerable question over `store`: one task per (path, topic) whose answer has
    1..`max_answers` entities, phrased with a seed-chosen template.

    templates: path -> phrasings with a `{topic}` placeholder; default `default_templates` over
        the store's relations. Task ids are `kgsyn-<hops>-<index>`, indexed per hop count in
        (path, topic) order, so they do not change when other hop counts are added.
    """
    if max_answers < 1:
        raise ValueError(f"max_answers must be >= 1, got {max_answers}")
    templates = default_templates(_forward_relations(store)) if templates is None else templates
    tasks: list[Task] = []
    index_by_hops: dict[int, int] = {}
    for path in _select_paths(templates, hops):
        for topic in sorted(store.entities_with(path[0])):
            answer = path_answer(store, topic, path)
            if not 1 <= len(answer) <= max_answers:
                continue
            index = index_by_hops.get(len(path), 0)
            index_by_hops[len(path)] = index + 1
            template = _phrase(templates, path, topic, seed)
            tasks.append(_make_task(f"kgsyn-{len(path)}-{index}", template, topic, path, answer))
    return tasks


def split_by_entity(tasks: Sequence[Task], eval_fraction: float, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Split tasks so no eval task's topic entity is the topic of any train task.

    A seeded shuffle of the distinct topics puts round(eval_fraction * #topics) of them in eval;
    both lists keep the input order.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    topics = sorted({t.meta["topic"] for t in tasks})
    random.Random(seed).shuffle(topics)
    held_out = set(topics[: round(eval_fraction * len(topics))])
    train = [t for t in tasks if t.meta["topic"] not in held_out]
    evaluation = [t for t in tasks if t.meta["topic"] in held_out]
    return train, evaluation


# -- the oracle ------------------------------------------------------------------------------


def tool_call_text(name: str, arguments: dict[str, str]) -> str:
    """One Hermes-format tool call: `<tool_call>\\n{json}\\n</tool_call>`, name first.

    Non-ASCII entity names are written as they are (not \\u-escaped) so the model copies them
    from the question character for character.
    """
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def oracle_relation_path(task: Task) -> list[str]:
    """The relations that solve `task`, in order (from `task.meta["path"]`)."""
    if "path" not in task.meta:
        raise ValueError(f"task {task.task_id} has no meta['path']: the oracle needs its relation path")
    return list(task.meta["path"])


def oracle_turns(
    task: Task,
    rng: random.Random,
    relation_noise: float = 0.0,
    store: TripleStore | None = None,
) -> list[str]:
    """Assistant turns that solve `task`: one `get_neighbors` call per hop (the first from the
    topic entity, each next one from the previous variable), then `Final Answer: #<last>`.

    With probability `relation_noise` per hop the oracle calls a wrong relation instead, drawn
    uniformly from the other relations available at that point: those of the current entities
    (what `get_relations` shows) that reach at least one entity the env does not hide. So
    `store` is required when `relation_noise > 0`. After a wrong hop the intended relation may
    be unavailable; the oracle then walks a uniformly drawn available one, so every call still
    succeeds and the variables stay numbered #0, #1, ...
    """
    if not 0.0 <= relation_noise <= 1.0:
        raise ValueError(f"relation_noise must be in [0, 1], got {relation_noise}")
    if relation_noise > 0 and store is None:
        raise ValueError("oracle_turns with relation_noise > 0 needs the store, to draw wrong relations "
                         "from those available")
    path = oracle_relation_path(task)
    ref = task.meta["topic"]
    hidden = {ref} if task.meta.get("exclude_topic") else set()
    current = {ref}
    strayed = False
    turns = []
    for k, intended in enumerate(path):
        relation = intended
        if store is not None:
            available = sorted(
                r for r in {r for e in current for r in store.relations(e)} if store.expand(current, r) - hidden
            )
            if intended not in available:
                if not strayed:
                    raise ValueError(f"task {task.task_id}: relation {intended!r} is not available at hop "
                                     f"{k}: the task does not match this store")
                relation = rng.choice(available)
            elif rng.random() < relation_noise:
                wrong = [r for r in available if r != intended]
                if wrong:
                    relation = rng.choice(wrong)
                    strayed = True
            current = store.expand(current, relation) - hidden
        turns.append(tool_call_text("get_neighbors", {"variable": ref, "relation": relation}))
        ref = f"#{k}"
    turns.append(f"Final Answer: #{len(path) - 1}")
    return turns


# -- MetaQA ----------------------------------------------------------------------------------

# MetaQA qtype words -> kb.txt relations.
_QTYPE_RELATIONS = {
    "actor": "starred_actors",
    "director": "directed_by",
    "writer": "written_by",
    "year": "release_year",
    "language": "in_language",
    "genre": "has_genre",
    "tag": "has_tags",
    "tags": "has_tags",
    "imdbrating": "has_imdb_rating",
    "imdbvotes": "has_imdb_votes",
}

_TOPIC = re.compile(r"\[([^\]]+)\]")


def qtype_to_path(qtype: str) -> list[str]:
    """A MetaQA qtype such as `actor_to_movie_to_director` as a relation path
    (`["starred_actors_inv", "directed_by"]`): `X_to_movie` walks backwards, `movie_to_X` forward."""
    words = qtype.strip().split("_to_")
    path = []
    for a, b in zip(words, words[1:]):
        if a == "movie" and b in _QTYPE_RELATIONS:
            path.append(_QTYPE_RELATIONS[b])
        elif b == "movie" and a in _QTYPE_RELATIONS:
            path.append(inverse(_QTYPE_RELATIONS[a]))
        else:
            raise ValueError(f"unknown MetaQA qtype step {a}_to_{b} in {qtype!r}: every step must go to or "
                             f"from 'movie' and name one of {sorted(_QTYPE_RELATIONS)}")
    if not path:
        raise ValueError(f"MetaQA qtype {qtype!r} has no '_to_' step")
    return path


def _metaqa_dir(data_dir: str | Path) -> Path:
    path = Path(data_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"MetaQA folder {path} not found: set the config field data.metaqa_dir to the "
                                "folder holding kb.txt and 1-hop/ 2-hop/ 3-hop/")
    return path


def load_metaqa_questions(
    data_dir: str | Path,
    hops: int,
    split: str = "test",
    sample: int | None = None,
    seed: int = 0,
) -> list[Task]:
    """MetaQA's `{hops}-hop/qa_{split}.txt` questions with their qtype relation paths.

    Task ids are `metaqa-<hops>hop-<split>-<line index>`; `answer` is the sorted gold set;
    meta holds topic, path, hops, qtype and exclude_topic (True for hops >= 2).
    sample: keep a seeded sample of this many questions (in file order).
    """
    folder = _metaqa_dir(data_dir) / f"{hops}-hop"
    qa_file, qtype_file = folder / f"qa_{split}.txt", folder / f"qa_{split}_qtype.txt"
    for f in (qa_file, qtype_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: check hops={hops} (1, 2 or 3), split={split!r} "
                                    "(test or dev) and the config field data.metaqa_dir")
    qa_lines = qa_file.read_text(encoding="utf-8").splitlines()
    qtypes = qtype_file.read_text(encoding="utf-8").splitlines()
    if len(qa_lines) != len(qtypes):
        raise ValueError(f"{qa_file} has {len(qa_lines)} lines but {qtype_file} has {len(qtypes)}: "
                         "they must be line-aligned")
    indices = range(len(qa_lines))
    if sample is not None:
        if not 0 < sample <= len(qa_lines):
            raise ValueError(f"sample={sample} must be in 1..{len(qa_lines)} (the questions in {qa_file})")
        indices = sorted(random.Random(seed).sample(range(len(qa_lines)), sample))

    tasks = []
    for i in indices:
        parts = qa_lines[i].split("\t")
        topic = _TOPIC.search(parts[0])
        if len(parts) != 2 or topic is None:
            raise ValueError(f"{qa_file}:{i + 1}: expected 'question with [topic]<TAB>answer|answer', "
                             f"got {qa_lines[i]!r}")
        path = qtype_to_path(qtypes[i])
        if len(path) != hops:
            raise ValueError(f"{qtype_file}:{i + 1}: qtype {qtypes[i]!r} has {len(path)} hops, expected {hops}")
        tasks.append(Task(
            task_id=f"metaqa-{hops}hop-{split}-{i}",
            prompt=parts[0],
            answer=sorted(set(parts[1].split("|"))),
            meta={"topic": topic.group(1), "path": path, "hops": hops, "qtype": qtypes[i].strip(),
                  "exclude_topic": hops >= 2},
        ))
    return tasks


def generate_metaqa_training_questions(
    store: TripleStore,
    seed: int,
    n: int,
    hops: Iterable[int] = (1, 2),
    exclude_topics: Iterable[str] = (),
    max_answers: int = 5,
    templates: Templates | None = None,
) -> list[Task]:
    """`n` questions over a (MetaQA) store in tiderl's own wording, never on a topic in
    `exclude_topics` (pass the topics of the eval questions to keep them held out).

    Each draw picks a path uniformly, then a topic uniformly among the entities that start
    it; duplicates and answers outside 1..`max_answers` are redrawn. Task ids are
    `kggen-<hops>-<index>`. Raises ValueError when `n` questions cannot be found.
    """
    if n < 1 or max_answers < 1:
        raise ValueError(f"n and max_answers must be >= 1, got n={n}, max_answers={max_answers}")
    templates = default_templates(_forward_relations(store)) if templates is None else templates
    excluded = set(exclude_topics)
    candidates = {p: sorted(store.entities_with(p[0]) - excluded) for p in _select_paths(templates, hops)}
    paths = [p for p, topics in candidates.items() if topics]
    if not paths:
        raise ValueError("no topic entity is left for any template path: exclude_topics covers them all")

    rng = random.Random(seed)
    seen: set[tuple[tuple[str, ...], str]] = set()
    tasks: list[Task] = []
    max_draws = 200 * n
    for _ in range(max_draws):
        if len(tasks) == n:
            break
        path = rng.choice(paths)
        topic = rng.choice(candidates[path])
        if (path, topic) in seen:
            continue
        seen.add((path, topic))
        answer = path_answer(store, topic, path)
        if 1 <= len(answer) <= max_answers:
            template = _phrase(templates, path, topic, seed)
            tasks.append(_make_task(f"kggen-{len(path)}-{len(tasks)}", template, topic, path, answer))
    if len(tasks) < n:
        raise ValueError(f"found only {len(tasks)} of n={n} questions in {max_draws} draws: lower n or "
                         f"raise max_answers={max_answers}")
    return tasks
