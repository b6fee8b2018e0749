"""No machine-specific absolute paths in the repository: data is found through `data.data_dir`,
$TIDERL_DATA_DIR or ../shared/data, venvs through a variable or a make target's folder, models
through model.cache_dir or $TIDERL_CACHE. An absolute path into one machine's work or home folder
works there only: on another the test or benchmark that reads it skips, or fails, for no reason a
reader can see.

Scanned: every text file of tiderl/, tests/, benchmarks/, configs/, docs/, the Makefile, the README
and pyproject.toml, code, comments and docs alike (a comment that says where the venv is, is
read and copied)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tiderl", "tests", "benchmarks", "configs", "docs", "Makefile", "README.md", "pyproject.toml", ".ci")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh", ""}

# An absolute path under a folder that belongs to a machine or a user: starting a word, a quoted
# string, a value (`=`, `:`) or a list item.
MACHINE_PATH = re.compile(r"(?:^|(?<=[\s'\"`=(\[,:]))/(?:work|home|root|Users|mnt|scratch|tmp|var/tmp)/[^\s'\"`)\],;]*")

# Where an absolute path is the point of the test: a place the code under test must keep out of.
ALLOWED = {
    # The sandbox must not let a program write to the host's /tmp (env_code.md's guarantees).
    ("tests/test_sandbox.py", "/tmp/%s"), ("tests/test_sandbox.py", "/tmp/{name}"),
    ("docs/env_code.md", "/tmp/x"),
    # SQL that a read-only database connection must refuse, or that the SQL classifier must name.
    ("tests/test_db_fuzz.py", "/tmp/x.db"), ("tests/test_db_fuzz.py", "/tmp/copy.db"),
    ("tests/test_db_sql_text.py", "/tmp/x"),
    # Adversarial statements a database server must refuse (writing a file on the server's host).
    ("tests/test_db_server.py", "/tmp/tiderl_evil.csv"),
}


def machine_paths(root: Path = ROOT) -> list[str]:
    """'file:line: path' for each machine-specific absolute path under `root` not in ALLOWED."""
    found = []
    for top in SCANNED:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for path in files:
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                continue
            where = path.relative_to(root).as_posix()
            if where == "tests/test_no_machine_paths.py":  # this file: its examples are the point
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                for match in MACHINE_PATH.finditer(line):
                    if (where, match.group()) not in ALLOWED:
                        found.append(f"{where}:{number}: {match.group()}")
    return found


def test_no_machine_specific_paths():
    found = machine_paths()
    assert found == [], ("absolute paths of one machine (use data.data_dir / $TIDERL_DATA_DIR / ../shared/data for "
                         "data, a variable or a make target's folder for venvs):\n" + "\n".join(found))


def test_the_scan_finds_machine_paths(tmp_path):
    # The machine paths of this example are spelled with `r` (the root) so that this file holds none.
    r = "/"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        f'DATA = Path("{r}work/shared/data")  # fine: ../shared/data\n'
        f'VENV = os.environ.get("V", "{r}home/me/venv/bin/python")\n'
        f'NOT = "a{r}work/b and ~{r}work/c and $HOME/x and {{root}}{r}tmp/y and {r}proc/self/maps"\n')
    (tmp_path / "Makefile").write_text(f"run:\n\t{r}root/venv/bin/python x.py\n")
    (tmp_path / "tests" / "test_sandbox.py").write_text(f"p = '{r}tmp/%s'\nq = '{r}tmp/other'\n")
    assert machine_paths(tmp_path) == [
        f"tests/test_sandbox.py:2: {r}tmp/other", f"tests/test_x.py:1: {r}work/shared/data",
        f"tests/test_x.py:2: {r}home/me/venv/bin/python", f"Makefile:2: {r}root/venv/bin/python"]
