"""Checkpoints that resume, written atomically (the completion marker last, then one rename); a
data-parallel run's ranks write DCP shards (`save_sharded`, `load_sharded`); `export_actor` makes
any checkpoint's actor a plain Hugging Face directory. The layout: docs/architecture.md,
"Checkpoints and resume", and docs/scale.md, "Checkpoints: sharded, consolidated, exported".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiderl.models.loading import load_model, load_policy, lora_base_of, save_model_dir
from tiderl.train.critic import LORA_STATE, ValueModel, load_lora_critic
from tiderl.train.learner import Learner
from tiderl.train.lora import is_lora

logger = logging.getLogger(__name__)

MARKER = "tiderl_checkpoint.json"
SHARDED = "sharded"  # the DCP directory of a data-parallel run's checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(path: str | Path, step: int, actor: Learner, critic: Learner | None,
                    tokenizer: Any, state: dict[str, Any] | None = None,
                    curiosity: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                    shards: Callable[[Path], dict[str, Any]] | None = None) -> Path:
    """Write a checkpoint of the actor, the critic (when the algorithm has one), their
    optimizers and `state` at `step`, atomically (docs/architecture.md). `meta` goes into the
    marker (e.g. the algorithm's name, for error messages on resume). `shards(dir)`, when given,
    has the data-parallel ranks write the weights and optimizer states into `dir` (the sharded
    layout; it returns what the marker records under "sharded"). Returns the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    sharded = None
    if shards is None:
        save_model_dir(actor.model, tokenizer, tmp / "actor")
        if critic is not None:
            critic.model.save(tmp / "critic")
    else:
        sharded = shards(tmp / SHARDED)
        actor.model.config.save_pretrained(tmp / "actor_config")
        tokenizer.save_pretrained(tmp / "actor_config")
        if is_lora(actor.model):  # the shards hold base and adapters under peft's names: export rebuilds it
            actor.model.peft_config["default"].save_pretrained(tmp / "actor_config")
    torch.save({
        "step": step,
        "actor_optimizer": actor.optimizer.state_dict() if shards is None else None,
        "critic_optimizer": critic.optimizer.state_dict() if critic is not None and shards is None else None,
        "torch_rng": torch.get_rng_state(),
        **(state or {}),
    }, tmp / "trainer_state.pt")
    if curiosity is not None:
        (tmp / "curiosity.json").write_text(json.dumps(curiosity))
    (tmp / MARKER).write_text(json.dumps({"step": step, "time": time.time(), "has_critic": critic is not None,
                                          **({"sharded": sharded} if shards is not None else {}), **(meta or {})}))
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():  # e.g. `final` saved again: swap, then delete the old one
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)
    return path


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def latest_checkpoint(checkpoints: str | Path) -> Path | None:
    """The complete `step_N` checkpoint with the largest N under `checkpoints` (None when there
    is none). Half-written ones are skipped with a log line."""
    root = Path(checkpoints)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        m = _STEP_DIR.match(p.name)
        if m is None or not is_complete(p):
            if m is not None or ".tmp-" in p.name:
                logger.warning("ignoring %s: a half-written checkpoint (no %s completion marker; the run "
                               "stopped while saving it)", p, MARKER)
            continue
        if best is None or int(m.group(1)) > best[0]:
            best = (int(m.group(1)), p)
    return None if best is None else best[1]


def prune_checkpoints(checkpoints: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete `step_N` checkpoints (0 = keep all), and
    the temporary directories of saves that never finished (left by a process that died while
    saving; this process's own are in use); returns what it deleted."""
    root = Path(checkpoints)
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".") and ".tmp-" in p.name
            and not p.name.endswith(f".tmp-{os.getpid()}")]
    if keep_last > 0:
        steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                       if (m := _STEP_DIR.match(p.name)) and is_complete(p))
        gone += [p for _, p in steps[:-keep_last]]
    for p in gone:
        shutil.rmtree(p)
    return gone


def load_checkpoint(path: str | Path, actor: Learner, critic: Learner | None,
                    ranks_load: bool = False) -> dict[str, Any]:
    """Restore models and optimizers in place from `path`; returns the saved trainer state (its
    "step" is the step to continue from; the caller restores the rest).

    A sharded checkpoint loads whole into this process; with `ranks_load` (a data-parallel run)
    only the weights load here (the driver's mirror) and the state's "sharded" names the DCP
    directory that the ranks load themselves (`load_sharded`). A checkpoint of one process
    cannot go to ranks (its optimizer state is one process's): that is refused."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"train.resume={path}: no such checkpoint directory. Fix: train.resume=auto "
                                "(the latest complete checkpoint of run_dir) or a <run_dir>/checkpoints/step_N dir.")
    if not is_complete(path):
        if (path / "actor").exists() or (path / "trainer_state.pt").exists() or ".tmp-" in path.name:
            raise FileNotFoundError(
                f"{path} is a half-written checkpoint: it has no {MARKER} completion marker (the run stopped "
                "while saving it). Fix: train.resume=auto picks the latest complete checkpoint, or name an "
                "earlier <run_dir>/checkpoints/step_N.")
        raise FileNotFoundError(
            f"{path} is not a tiderl checkpoint (no {MARKER}). Fix: train.resume=auto, or point "
            "train.resume at a <run_dir>/checkpoints/step_N directory.")
    marker = json.loads((path / MARKER).read_text())
    if "sharded" in marker:
        return _load_sharded_checkpoint(path, marker, actor, critic, ranks_load)
    if ranks_load:
        raise ValueError(
            f"train.resume={path}: this checkpoint was saved by one process (train.parallel=none); its optimizer "
            "state loads into one process, not into data-parallel ranks. Fix: resume it with train.parallel=none "
            "(a checkpoint of a train.parallel=ddp|fsdp2 run resumes under any train.parallel).")
    if (path / "actor" / "adapter_config.json").is_file():  # a LoRA policy: the actor dir holds its adapters
        _load_adapters(path / "actor", actor.model)
    else:
        saved_actor = load_model(path / "actor", device="cpu")
        actor.model.load_state_dict(saved_actor.state_dict())
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    if critic is not None:
        if state["critic_optimizer"] is None or not (path / "critic").is_dir():
            raise _critic_missing(path, marker)
        if is_lora(getattr(critic.model, "backbone", None)):
            load_lora_critic(critic.model, path / "critic")
        else:
            if (path / "critic" / LORA_STATE).is_file():
                raise ValueError(f"{path / 'critic'} holds a LoRA critic, and this run's critic is fully trained. "
                                 "Fix: resume with model.critic_lora=lora and the model.lora settings it was "
                                 "trained with.")
            critic.model.load_state_dict(ValueModel.load(path / "critic").state_dict())
        critic.optimizer.load_state_dict(state["critic_optimizer"])
    actor.optimizer.load_state_dict(state["actor_optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return state


def _critic_missing(path: Path, marker: dict[str, Any]) -> ValueError:
    saved_by = f" (algo.name={marker['algo']})" if marker.get("algo") else ""
    return ValueError(
        f"{path} holds no critic: it was saved by an algorithm without a critic{saved_by}, and this run's "
        "algorithm needs one. Fix: resume it with the algo.name it was trained with (see config.yaml beside "
        "its checkpoints/).")


def _load_sharded_checkpoint(path: Path, marker: dict[str, Any], actor: Learner, critic: Learner | None,
                             ranks_load: bool) -> dict[str, Any]:
    if critic is not None and not marker.get("has_critic"):
        raise _critic_missing(path, marker)
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    if ranks_load:
        load_sharded_weights(path / SHARDED, actor.model, "actor")
        if critic is not None:
            load_sharded_weights(path / SHARDED, critic.model, "critic")
        state["sharded"] = str(path / SHARDED)
    else:
        load_sharded(path / SHARDED, actor, critic)
    torch.set_rng_state(state["torch_rng"])
    return state


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when there is no process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _learner_state(learner: Learner) -> dict[str, Any]:
    """A learner's weights and optimizer state under the model's parameter names (DTensor
    shards for FSDP2, whole tensors for DDP and one process): what DCP saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(learner.model, learner.optimizer)
    return {"model": model_state, "optim": optim_state}


def save_sharded(path: str | Path, actor: Learner, critic: Learner | None) -> None:
    """Save the actor's and the critic's weights and optimizer states to `path` with DCP, and
    this rank's torch RNG state. With a process group it is a collective (every rank calls it,
    each writes its shards; replicated DDP tensors are written once); without one, this process
    writes everything."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = {"actor": _learner_state(actor)}
    if critic is not None:
        state["critic"] = _learner_state(critic)
    with _dcp_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    torch.save(torch.get_rng_state(), path / f"rng_rank{_rank()}.pt")


def load_sharded(path: str | Path, actor: Learner, critic: Learner | None) -> None:
    """Load what `save_sharded` wrote into this rank's (or this process's) learners, resharded to
    their layout (any world size, DDP, FSDP2 or none), and this rank's RNG state when the saving
    run had this rank. A collective with a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    parts = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    state = {name: _learner_state(learner) for name, learner in parts.items()}
    try:
        with _dcp_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as err:  # DCP's own message names the key, not the cause or the fix
        raise ValueError(f"the sharded checkpoint {path} does not fit this run's models ({type(err).__name__}: "
                         f"{str(err)[:300]}). Fix: resume with the model.* and algo.* settings it was trained "
                         "with (see config.yaml beside its checkpoints/).") from err
    for name, learner in parts.items():
        set_state_dict(learner.model, learner.optimizer, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"])
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng))


def load_sharded_weights(path: str | Path, model: torch.nn.Module, part: str = "actor") -> None:
    """Read the whole weights of `part` ("actor" or "critic") from a sharded checkpoint into a
    plain model in this process (no process group needed): the driver's mirror, or an export."""
    import torch.distributed.checkpoint as dcp

    weights = model.state_dict()
    with _dcp_quiet():
        dcp.load({part: {"model": weights}}, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(weights)


def _load_adapters(adapter_dir: Path, model: torch.nn.Module) -> None:
    """Load the LoRA adapters saved in `adapter_dir` into the peft model `model`."""
    from safetensors.torch import load_file

    if not is_lora(model):
        raise ValueError(f"{adapter_dir} holds LoRA adapters and this run's policy has none. Fix: resume with the "
                         "model.lora settings it was trained with (model.lora.r > 0).")
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing:
        raise ValueError(f"{adapter_dir} lacks adapters this run's policy has ({missing[:3]}). Fix: resume with the "
                         "model.lora settings (r, target_modules) it was trained with.")


def export_actor(checkpoint: str | Path, out: str | Path, base_model: str | Path | None = None) -> Path:
    """Write the actor of `checkpoint` to `out` as a plain Hugging Face model directory (weights,
    config, tokenizer with its chat template): the whole weights gathered from a sharded
    checkpoint (a LoRA policy's with its adapters merged in: its shards hold the base too), or a
    single-process LoRA policy's adapters merged into its base model (`base_model`, by default
    the base model directory the adapters name). `out` must not exist yet; it appears whole (a
    temporary directory renamed at the end). Returns `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiderl.models.loading import load_tokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    if not is_complete(checkpoint):
        raise FileNotFoundError(f"{checkpoint} is not a complete tiderl checkpoint (no {MARKER}). Fix: point "
                                "--checkpoint at a <run_dir>/checkpoints/step_N or final directory.")
    if out.exists():
        raise FileExistsError(f"{out} exists. Fix: pass a new --out directory (export never overwrites).")
    marker = json.loads((checkpoint / MARKER).read_text())
    if "sharded" in marker:
        source = checkpoint / "actor_config"
        config = AutoConfig.from_pretrained(source)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
        if (source / "adapter_config.json").is_file():  # a LoRA policy's ranks: base and adapters, then merged
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig.from_pretrained(str(source)))
            load_sharded_weights(checkpoint / SHARDED, model, "actor")
            model = model.merge_and_unload()
        else:
            load_sharded_weights(checkpoint / SHARDED, model, "actor")
    elif lora_base_of(checkpoint / "actor") is not None:
        source = checkpoint / "actor"
        model = load_policy(source, base_model=base_model).merge_and_unload()
        source = Path(base_model) if base_model else lora_base_of(source)  # the tokenizer: the base model's
    else:
        source = checkpoint / "actor"
        model = load_model(source)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model_dir(model, load_tokenizer(source), tmp)
    tmp.rename(out)
    return out
