"""Does a vision-language model read the grid? A cheap probe on `visual_grid` (issue 31).

For each task, the model scores the four possible first turns (`move` up, down, left, right)
after the task's first prompt, which is the same text for every grid (the picture alone says
where things are). The probabilities of the four direction words at the token where the turn
names its direction, renormalised over the four, give the model's choice of first move. Scored three times:

- `true`: with the task's own picture;
- `swapped`: with another task's picture (task i gets task i+1's, in the order given);
- `blank`: with an empty floor picture of the same size (no agent, no goal, no walls).

A model that reads the picture loses more (negative log of the probability it gives the right
moves) with a swapped or blank picture than with its own, and picks a right first move more
often with its own. A model that ignores it scores all three alike. "Right" is any move that
starts a shortest path (there may be two). No sampling, no generation: one forward pass per
(task, picture).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tiderl.envs.protocol import Task
from tiderl.envs.visual.grid import DIRECTIONS, FLOOR, layout_of, shortest_moves, tool_call_text
from tiderl.train.batching import collate
from tiderl.models.vision import model_inputs
from tiderl.types import Trajectory

VARIANTS = ("true", "swapped", "blank")


def right_first_moves(task: Task) -> set[str]:
    """The directions whose move starts a shortest path from the task's start to its goal."""
    size, walls, start, goal = layout_of(task)
    best = len(shortest_moves(size, walls, start, goal) or [])
    right = set()
    for name, (dr, dc) in DIRECTIONS.items():
        cell = (start[0] + dr, start[1] + dc)
        if 0 <= cell[0] < size and 0 <= cell[1] < size and cell not in walls:
            rest = shortest_moves(size, walls, cell, goal)
            if rest is not None and len(rest) == best - 1:
                right.add(name)
    return right


def first_prompts(tokenizer: Any, setup: Any, tasks: list[Task], cfg: Any) -> list[tuple[list[int], Any]]:
    """(tokens of the first prompt, its picture) of each task, as the agent loop renders them."""
    from tiderl.models.warmstart import scripted_traces

    traces = scripted_traces(tokenizer, setup, tasks, [setup.oracle(t)[:1] for t in tasks], cfg)
    out = []
    for task, trace in zip(tasks, traces):
        if 1 not in trace.loss_mask or not trace.images:
            raise ValueError(f"task {task.task_id}: its first prompt shows no picture or the episode has no model "
                             "turn: the probe needs env.options.images=true")
        out.append((trace.tokens[:trace.loss_mask.index(1)], trace.images[0]))
    return out


def direction_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(the tokens every first turn starts with, the token after them of each direction in
    `DIRECTIONS` order): the model picks its move at that one token. ValueError when two
    directions share it (a tokenizer that splits the words differently)."""
    turns = [tokenizer.encode(tool_call_text("move", {"direction": d}), add_special_tokens=False) for d in DIRECTIONS]
    common = 0
    while all(len(t) > common and t[common] == turns[0][common] for t in turns):
        common += 1
    choices = [t[common] if len(t) > common else -1 for t in turns]
    if -1 in choices or len(set(choices)) != len(choices):
        raise ValueError("the tokenizer does not tell the four directions apart at one token after their common "
                         f"start ({choices}): the probe cannot score them")
    return turns[0][:common], choices


@torch.no_grad()
def direction_logprobs(model: Any, tokenizer: Any, prompts: list[tuple[list[int], Any]],
                       batch_size: int = 32) -> torch.Tensor:
    """`[len(prompts), 4]`: log-probabilities of the four moves (in `DIRECTIONS` order) at the token
    where the first turn names its direction, after each (prompt tokens, picture), renormalised over
    the four (one forward pass per prompt)."""
    image_processor = getattr(tokenizer, "image_processor", None)
    if image_processor is None:
        raise ValueError("the probe needs a vision-language model's processor (with an image_processor) as tokenizer")
    common, choices = direction_tokens(tokenizer)
    rows = []
    for prompt, image in prompts:
        tokens = prompt + common
        rows.append(Trajectory(tokens, [0] * len(tokens), [0.0] * len(tokens), [-1] * len(tokens), images=[image]))
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = collate(chunk, tokenizer.pad_token_id, image_processor)
        inputs = model_inputs(model, batch.input_ids, batch.pixels)
        logits = model(**inputs, attention_mask=batch.attention_mask, use_cache=False).logits
        last = torch.tensor([len(r.tokens) - 1 for r in chunk])
        out.append(torch.log_softmax(logits[torch.arange(len(chunk)), last][:, choices].float(), dim=-1))
    model.train(was_training)
    return torch.cat(out)


def _blank_like(image: Any) -> Any:
    from PIL import Image

    return Image.new("RGB", image.size, FLOOR)


def probe(model: Any, tokenizer: Any, setup: Any, tasks: list[Task], cfg: Any, batch_size: int = 32) -> dict:
    """The probe of the module docstring on `tasks` (at least 2, with pictures). Returns, for each
    variant in `VARIANTS`: `loss` (mean over tasks of -log P(a right first move)), `accuracy` (share
    of tasks whose most likely first move is right); and `gap_swapped` / `gap_blank`: the mean
    per-task loss increase over `true`, with its standard error (`*_se`). ln 4 = 1.386 is the loss
    of a model that gives the four moves equal probability."""
    if len(tasks) < 2:
        raise ValueError(f"the probe needs at least 2 tasks to swap pictures between, got {len(tasks)}")
    prompts = first_prompts(tokenizer, setup, tasks, cfg)
    images = [image for _, image in prompts]
    variants = {"true": images, "swapped": images[1:] + images[:1], "blank": [_blank_like(i) for i in images]}
    right = [torch.tensor([d in right_first_moves(t) for d in DIRECTIONS]) for t in tasks]
    out: dict[str, Any] = {"tasks": len(tasks), "uniform_loss": math.log(len(DIRECTIONS))}
    losses = {}
    for name, shown in variants.items():
        logp = direction_logprobs(model, tokenizer, [(p, i) for (p, _), i in zip(prompts, shown)], batch_size)
        losses[name] = torch.stack([-torch.logsumexp(row[mask], 0) for row, mask in zip(logp, right)])
        picked = logp.argmax(1)
        out[name] = {"loss": round(losses[name].mean().item(), 4),
                     "accuracy": round(sum(bool(m[p]) for m, p in zip(right, picked)) / len(tasks), 4)}
    for name in ("swapped", "blank"):
        gap = losses[name] - losses["true"]
        out[f"gap_{name}"] = round(gap.mean().item(), 4)
        out[f"gap_{name}_se"] = round((gap.std() / math.sqrt(len(gap))).item(), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m tiderl.embedded.vlm_probe --config C [--model DIR] [--tasks N] [key=value ...]`: the
    probe on the first N held-out tasks of the config's setup, with the model in DIR (default: the
    config's embedded tiny model, which must be built already), printed as JSON."""
    import argparse
    import json

    from tiderl.config import load_config
    from tiderl.embedded.build import embedded_model_dir
    from tiderl.envs.setup import load_setup
    from tiderl.models.loading import load_model, load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m tiderl.embedded.vlm_probe", description=main.__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", default="", help="a vision-language model directory")
    parser.add_argument("--tasks", type=int, default=200, help="held-out tasks probed")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    path = args.model or str(embedded_model_dir(cfg))
    model, tokenizer = load_model(path, dtype="float32", device="cpu"), load_tokenizer(path)
    setup = load_setup(cfg)
    print(json.dumps({"model": path, **probe(model, tokenizer, setup, setup.eval_tasks[:args.tasks], cfg)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
