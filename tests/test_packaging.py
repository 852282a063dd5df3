"""Packaging invariants: the top-level folders map onto pdserve.*, nothing shadows the standard library, and the
declared Python floor is the one CI runs (the no-pickle scan of every source folder is tests/test_no_pickle.py)."""

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB_OPERATOR = Path(subprocess.check_output([sys.executable, "-I", "-c", "import operator; print(operator.__file__)"],
                                               text=True).strip())


@pytest.mark.parametrize("flags", [[], ["-S"]], ids=["site", "no-site"])
def test_import_operator_from_repo_root_is_stdlib(flags):
    out = subprocess.run([sys.executable, *flags, "-c", "import operator, collections; print(operator.__file__);"
                          "print(operator.itemgetter(1)([0, 7]))"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(STDLIB_OPERATOR), "7"]


def test_import_operator_in_bare_venv_is_stdlib(tmp_path):
    # A venv without pip has no .pth files, so nothing preloads the stdlib `operator` before the repo root is searched.
    venv.create(tmp_path / "bare", with_pip=False)
    py = tmp_path / "bare" / "bin" / "python"
    out = subprocess.run([str(py), "-c", "import operator, json; print(operator.__file__, operator.eq(1, 1))"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "True" and Path(out.stdout.split()[0]).name == "operator.py"
    assert Path(out.stdout.split()[0]).parent != ROOT / "operator"


def test_pdserve_operator_is_the_operator_folder():
    import pdserve.operator

    assert Path(pdserve.operator.__file__).resolve() == ROOT / "operator" / "__init__.py"


def test_block_hash_and_kv_events_are_torch_free():
    code = "import sys, pdserve.runtime.block_hash, pdserve.runtime.kv_events; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], cwd="/", text=True).strip() == "False"


# The lowest Python pdserve supports is the one CI runs the suite on: router/app.py used Task.uncancel (3.11+) while
# pyproject declared >=3.10, and nothing ran on 3.10 to notice. Declared floor, README and CI interpreter must agree.
PYTHON_FLOOR = (3, 11)


def _declared_python_floor() -> tuple[int, int]:
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"\s*$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml must declare requires-python = \">=X.Y\""
    return int(m[1]), int(m[2])


def test_declared_python_floor_is_the_tested_one_and_the_readme_says_so():
    assert _declared_python_floor() == PYTHON_FLOOR
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"Python ≥ (\d+)\.(\d+)", quickstart) == [tuple(map(str, PYTHON_FLOOR))]
    assert sys.version_info[:2] >= PYTHON_FLOOR


def test_ci_runs_on_the_declared_python_floor():
    if os.environ.get("PDSERVE_CI") != "1":
        pytest.skip("only CI pins the interpreter: .ci/run sets PDSERVE_CI=1 (a developer may run a newer Python)")
    assert sys.version_info[:2] == _declared_python_floor(), (
        f"CI runs Python {sys.version.split()[0]}, but pyproject.toml declares >={'.'.join(map(str, PYTHON_FLOOR))}: "
        "run CI on the declared floor (make PYTHON=python3.X) so that newer-only APIs are caught")
