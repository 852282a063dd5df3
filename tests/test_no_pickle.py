"""No pickle-capable deserialization anywhere outside tests: one AST scan of every source folder (anchors §7).

Unpickling runs code chosen by whoever wrote the bytes; KV blocks, router messages, checkpoints and caches all cross a
network or a disk. The scan reads the syntax tree, so aliases (`import pickle as p`, `from torch import load`), dynamic
imports (`importlib.import_module("pickle")`, `__import__("dill")`) and keyword forms (`allow_pickle=True`) are caught
where a line regex missed them; the self-test below shows each form is caught and the safe forms are not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folders that must be scanned; the scan covers every top-level folder with Python in it, these included.
REQUIRED = {"runtime", "router", "kv_connectors", "kernels", "operator", "pdserve", "scripts", "benchmarks"}
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal", "pickletools"}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
IMPORTERS = {"importlib.import_module", "__import__", "importlib.__import__"}
NIXL_PICKLING = {"get_serialized_descs", "deserialize_descs"}   # NIXL's helpers pickle their descriptor lists
PICKLE_CALLS = {"read_pickle", "to_pickle", "Unpickler"}         # pandas / stdlib spelled as attributes


def _banned(module: str) -> bool:
    return module.split(".")[0] in BANNED_MODULES or module in ("six.moves.cPickle",)


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}   # local name -> dotted name it was imported as
        self.found: list[str] = []

    def _flag(self, node: ast.AST, why: str) -> None:
        self.found.append(f"line {node.lineno}: {why}: {ast.unparse(node)[:120]}")

    def _dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute) and (base := self._dotted(node.value)):
            return f"{base}.{node.attr}"
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            if _banned(a.name):
                self._flag(node, "imports a pickle-capable module")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for a in node.names:
            self.aliases[a.asname or a.name] = f"{module}.{a.name}"
            if _banned(module) or _banned(f"{module}.{a.name}") or a.name in BANNED_MODULES:
                self._flag(node, "imports a pickle-capable module")

    def visit_Call(self, node: ast.Call) -> None:
        name = self._dotted(node.func) or ""
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if name in IMPORTERS and node.args and _banned(_literal_prefix(node.args[0])):
            self._flag(node, "imports a pickle-capable module dynamically")
        if name in TORCH_LOADS and not (isinstance(kw.get("weights_only"), ast.Constant)
                                        and kw["weights_only"].value is True):
            self._flag(node, "torch.load without weights_only=True")
        if _banned(name) and name.count("."):
            self._flag(node, "calls a pickle-capable module")
        if isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is True:
            self._flag(node, "allow_pickle=True")
        if "pickle_module" in kw:
            self._flag(node, "a custom pickle_module")
        if isinstance(node.func, ast.Attribute) and node.func.attr in NIXL_PICKLING | PICKLE_CALLS:
            self._flag(node, "pickle-based (de)serialization helper")
        self.generic_visit(node)


def _literal_prefix(node: ast.expr) -> str:
    """The constant text of a module-name argument: a string, or an f-string's leading literal part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return ""


def violations(source: str) -> list[str]:
    scan = _Scan()
    scan.visit(ast.parse(source))
    return scan.found


def source_folders() -> list[Path]:
    return sorted(d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
                  and d.name != "tests" and next(d.rglob("*.py"), None) is not None)


UNSAFE = [
    "import pickle", "import cPickle", "import _pickle as p", "import dill", "import cloudpickle", "import marshal",
    "import shelve", "import joblib", "from pickle import loads", "from six.moves import cPickle",
    "import pickle as safe\nsafe.loads(b)", "x = pickle.loads(b)",
    "importlib.import_module('pickle')", "import importlib as il\nil.import_module('dill').loads(b)",
    "from importlib import import_module\nimport_module('cPickle')", "__import__('pickle')",
    "importlib.import_module(f'pickle')",
    "torch.load(f)", "torch.load(f, map_location=dict(a=1))", "torch.load(f, weights_only=False)",
    "torch.load(f, weights_only=flag)", "import torch as t\nt.load(f)", "from torch import load\nload(f)",
    "torch.serialization.load(f)", "torch.load(f, weights_only=True, pickle_module=dill)",
    "np.load(p, allow_pickle=True)", "numpy.load(p, allow_pickle=True)", "pd.read_pickle(p)",
    "agent.deserialize_descs(b)", "agent.get_serialized_descs(d)",
]
SAFE = [
    "torch.load(f, map_location='cpu', weights_only=True)", "msgpack.unpackb(b)", "# import pickle\nx = 'pickle'",
    "np.load(p)", "np.load(p, allow_pickle=False)", "importlib.import_module(f'pdserve.kernels.{m}')",
    "importlib.import_module(name)", "json.loads(b)", "from safetensors.torch import load_file\nload_file(p)",
]


@pytest.mark.parametrize("snippet", UNSAFE)
def test_scan_catches(snippet):
    assert violations(snippet), snippet


@pytest.mark.parametrize("snippet", SAFE)
def test_scan_accepts(snippet):
    assert violations(snippet) == []


def test_scan_covers_every_source_folder():
    assert REQUIRED <= {d.name for d in source_folders()}


def test_sources_have_no_pickle():
    bad = {}
    for folder in source_folders():
        for path in sorted(folder.rglob("*.py")):
            if found := violations(path.read_text()):
                bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"pickle-capable deserialization found: {bad}"
