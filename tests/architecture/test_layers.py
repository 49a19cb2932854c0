"""The import contracts in pyproject.toml (``lint-imports``): kept by the code as it is, and broken by
an import that points up a layer, by torch in a pure-Python package, and by a cycle of sibling modules."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="needs import-linter (the test extra)")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", str(root / "pyproject.toml")], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_code_keeps_every_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "kvos", tmp_path / "kvos", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize("module, line, contract", [
    ("cache/block.py", "import kvos.engine.llm_engine", "Layers"),  # the memory system reaching up to the engine
    ("scheduler/scheduler.py", "from kvos.worker import runner", "Layers"),
    ("models/llama.py", "import kvos.worker.runner", "Layers"),
    ("serve/protocol.py", "import kvos.distributed.dp_engine", "Layers"),  # siblings stay independent
    ("cache/router_view.py", "import kvos.router.policies", "Layers"),
    ("scheduler/describe.py", "import torch", "pure Python"),
    ("models/config.py", "import kvos.models.llama", "cycles"),
])
def test_a_wrong_import_breaks_a_contract(copy: Path, module: str, line: str, contract: str):
    path = copy / "kvos" / module
    path.write_text((path.read_text() if path.exists() else "") + f"\n{line}  # noqa\n")
    r = lint(copy)
    assert r.returncode != 0, r.stdout
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, r.stdout
