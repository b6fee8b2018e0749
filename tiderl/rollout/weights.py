"""Weight fingerprints: how the trainer checks that a weight sync arrived."""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Mapping

import numpy as np
import torch

# Elements read per tensor: evenly strided ones (every region of the tensor, whatever its layout)
# plus the same number at pseudo-random positions fixed by the tensor's name and size.
STRIDED_ELEMENTS = 64
RANDOM_ELEMENTS = 64


def sample_positions(name: str, numel: int) -> np.ndarray:
    """The flat positions of `name`'s tensor that `weights_checksum` reads (sorted, unique).

    They depend only on the name and the element count, so every process that fingerprints the
    same model reads the same elements: the first and the last, `STRIDED_ELEMENTS` evenly spaced,
    and `RANDOM_ELEMENTS` drawn by a generator seeded from the name and size.
    """
    if numel <= STRIDED_ELEMENTS + RANDOM_ELEMENTS:
        return np.arange(numel, dtype=np.int64)
    strided = np.linspace(0, numel - 1, STRIDED_ELEMENTS).astype(np.int64)
    rng = np.random.default_rng([zlib.crc32(name.encode("utf-8")), numel])
    drawn = rng.integers(0, numel, RANDOM_ELEMENTS, dtype=np.int64)
    return np.unique(np.concatenate([strided, drawn]))


@functools.lru_cache(maxsize=4096)
def _positions(name: str, numel: int) -> torch.Tensor:
    """`sample_positions` as a tensor, computed once per tensor name and size."""
    return torch.from_numpy(sample_positions(name, numel))


@functools.lru_cache(maxsize=4096)
def _offsets(name: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The storage offsets (relative to the tensor's own) of the elements `sample_positions` names
    in a strided tensor of `shape` and `stride`, then the largest offset."""
    positions = sample_positions(name, int(np.prod(shape, dtype=np.int64)))
    coords = np.unravel_index(positions, shape)
    offsets = sum((c.astype(np.int64) * s for c, s in zip(coords, stride)), np.zeros(len(positions), np.int64))
    return torch.from_numpy(np.append(offsets, offsets.max()))


def weights_checksum(state_dict: Mapping[str, torch.Tensor], cast: torch.dtype | None = None) -> float:
    """A fingerprint of a set of weights that costs a few elements per tensor, not a full pass: a
    BLAKE2b hash, over the tensors in sorted key order, of each one's name, shape, dtype and exact
    values at `sample_positions`, as a float that compares with `==`; the same in every process.
    With `cast`, the fingerprint the floating-point tensors would have once cast to that dtype
    (only the sampled elements are cast). What it catches and what it cannot: docs/architecture.md,
    "Numerics that hold"."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state_dict):
        tensor = state_dict[name].detach()
        if tensor.is_contiguous():
            values = tensor.reshape(-1)[_positions(name, tensor.numel()).to(tensor.device)]
        else:  # the same elements (row-major order) read in place, without copying the tensor
            offsets = _offsets(name, tuple(tensor.shape), tuple(tensor.stride())).to(tensor.device)
            values = tensor.as_strided((int(offsets[-1]) + 1,), (1,))[offsets[:-1]]
        values, dtype = values.to(device="cpu"), tensor.dtype
        if cast is not None and values.is_floating_point():
            values, dtype = values.to(cast), cast
        if values.is_floating_point() or values.is_complex():
            values = values.to(torch.complex128 if values.is_complex() else torch.float64)
        digest.update(f"{name}|{tuple(tensor.shape)}|{dtype}|".encode("utf-8"))
        digest.update(values.contiguous().numpy().tobytes())
    return float(int.from_bytes(digest.digest()[:7], "big") >> 4)


def published_checksum(weights: object) -> float:
    """What the rollout side must report after loading `weights`: the checksum published with
    weights that travel by reference (an object with `.checksum`, as the data-parallel trainer's
    ranks publish them), else `weights_checksum` of the state dict."""
    checksum = getattr(weights, "checksum", None)
    return checksum if checksum is not None else weights_checksum(weights)  # type: ignore[arg-type]
