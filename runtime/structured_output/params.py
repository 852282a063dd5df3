"""What one request asks its output to follow (vLLM's ``StructuredOutputsParams``, same field names).

Exactly one constraint is set: ``json`` (a JSON Schema, dict or text), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of these strings), ``grammar`` (EBNF/GBNF; Lark too with llguidance) or ``structural_tag`` (xgrammar's
structural tag JSON: free text with constrained segments). ``key()`` is the compile-cache key: the constraint's kind and
its canonical text (options included), so equal specs share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BACKEND_CHOICES = ("auto", "xgrammar", "llguidance")   # --structured-outputs-backend (backends.BACKENDS + auto)
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False         # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # objects of the schema accept no keys beyond "properties"
    backend: str | None = None                   # set by the engine's choice (auto) or the server's flag; not a client field

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        n = sum(getattr(self, k) not in (None, False) for k in KINDS)
        if n != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag (got {n})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The constraint as text: JSON for json/choice (key order kept: it is the generation order), else as given."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                schema = json.loads(schema)   # ValueError on bad JSON: the caller's 400
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            if self.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if kind == "json_object":
            return '{"type":"object"}'
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return str(getattr(self, kind))

    def key(self) -> tuple[str, str]:
        opts = "nows:" if self.disable_any_whitespace else ""
        return self.kind, opts + self.spec()


def _no_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema with ``properties`` gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
