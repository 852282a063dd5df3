"""Every ``PDSERVE_*`` environment variable the package reads is read in ``runtime/envs.py`` (the README says so).

The scan parses every source file of the package (tests and scripts have their own switches) and finds each read of
the environment: ``os.environ[K]``, ``os.environ.get(K)``, ``os.getenv(K)``, ``K in os.environ`` (``environ`` and
``getenv`` imported bare included). Each key must resolve to a string: a literal, an f-string's leading text, or a
module-level constant; a read whose key cannot be resolved fails too, so a ``PDSERVE_*`` read cannot hide behind a
variable.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("pdserve", "runtime", "router", "operator", "kv_connectors", "kernels")
ENVS = ROOT / "runtime" / "envs.py"


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv") or \
        (isinstance(node, ast.Name) and node.id == "getenv")


def _key(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def env_reads(source: str) -> list[tuple[int, str | None]]:
    """(line, key or None when it cannot be resolved) of every environment read in ``source``."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    reads = []
    for node in ast.walk(tree):
        key_node = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key_node = node.slice
        elif isinstance(node, ast.Call) and node.args and (
                _is_getenv(node.func) or (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                                          and _is_environ(node.func.value))):
            key_node = node.args[0]
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_environ(node.comparators[0]):
            key_node = node.left
        if key_node is not None:
            reads.append((node.lineno, _key(key_node, constants)))
    return reads


def test_the_scan_finds_reads_of_every_form():
    src = ('import os\nfrom os import environ, getenv\nK = "PDSERVE_A"\n'
           'os.environ["PDSERVE_B"]\nos.environ.get(K)\ngetenv(f"PDSERVE_{x}")\n"PDSERVE_C" in environ\n'
           'os.getenv(name)\nos.environ["X"] = "1"\n')
    assert env_reads(src) == [(4, "PDSERVE_B"), (5, "PDSERVE_A"), (6, "PDSERVE_"), (7, "PDSERVE_C"), (8, None)]


def test_pdserve_variables_are_read_only_in_envs():
    offenders = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ENVS:
                continue
            for line, key in env_reads(path.read_text()):
                if key is None or key.startswith("PDSERVE_"):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} reads {key or 'an unresolved key'}")
    assert not offenders, "read PDSERVE_* variables in runtime/envs.py only:\n" + "\n".join(offenders)
    assert [k for _, k in env_reads(ENVS.read_text())], "runtime/envs.py reads nothing: the scan is broken"
