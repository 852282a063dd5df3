"""No pickle on any KV, network or disk path: scan kv_connectors/ and runtime/ sources (anchors §7)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATTERNS = [
    re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|joblib|shelve|marshal)\b", re.M),
    re.compile(r"\b(c?pickle|dill|cloudpickle|marshal)\.(loads?|Unpickler|dumps?)\b"),
    re.compile(r"allow_pickle\s*=\s*True"),
    re.compile(r"\.get_serialized_descs\(|\.deserialize_descs\("),      # NIXL's pickle-based helpers
]
TORCH_LOAD = re.compile(r"\btorch\.load\s*\(")


def violations(text: str) -> list[str]:
    found = [m.group(0) for p in PATTERNS for m in p.finditer(text)]
    for m in TORCH_LOAD.finditer(text):
        depth, i = 0, m.end() - 1
        while i < len(text):                               # the call's argument list, nested parentheses included
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        if not re.search(r"weights_only\s*=\s*True", text[m.start():i]):
            found.append(text[m.start():i + 1])
    return found


@pytest.mark.parametrize("snippet", ["import pickle", "from pickle import loads", "x = pickle.loads(b)",
                                     "torch.load(f)", "torch.load(f, map_location=dict(a=1))",
                                     "np.load(p, allow_pickle=True)", "agent.deserialize_descs(b)"])
def test_detector_flags_unsafe_code(snippet):
    assert violations(snippet)


def test_detector_accepts_safe_code():
    assert not violations("torch.load(f, map_location='cpu', weights_only=True)\nmsgpack.unpackb(b)\n# pickled")


def test_sources_have_no_pickle():
    bad = {}
    for folder in ("kv_connectors", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if found := violations(path.read_text()):
                bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"pickle-capable deserialization found: {bad}"
