"""Grammar backends: compile a constraint for one tokenizer, make per-request matchers, fill token bitmasks by batch.

Contract (each backend, registered by name in ``BACKENDS``):
- ``compile(kind, spec)`` turns a ``StructuredOutputsParams.key()`` into a compiled grammar, or raises ``ValueError``
  with the reason (bad schema, regex or grammar). Thread-safe: the manager calls it from its compile threads.
- ``matcher(compiled)`` makes a fresh ``Matcher`` (one per request; touched only by the engine thread).
- ``fill_bitmask(matchers, rows, bitmask)`` writes the allowed-token bitmask of ``matchers[i]`` into
  ``bitmask[rows[i]]`` in one native call (threads inside), never a Python loop per row. ``bitmask``: int32
  ``(num_rows, ceil(vocab / 32))`` on the CPU, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed; both
  backends use this layout, so one tensor serves a mixed batch.

xgrammar (the default, as in vLLM and SGLang) compiles fast and masks fast; llguidance covers JSON Schema keywords that
xgrammar accepts but does not enforce (``allOf``) and Lark grammars. ``choose_backend`` picks per request.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

import torch


class Matcher(ABC):
    """One request's grammar state: advanced with every accepted token, rolled back for rejected drafts."""

    @abstractmethod
    def accept(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and no advance past the bad token) when the grammar refuses one."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may be generated."""


class _NativeMatcher(Matcher):
    """A backend's native matcher behind ``Matcher``: both natives roll back by a token count."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)


class _XgrMatcher(_NativeMatcher):   # xgrammar.GrammarMatcher
    def accept(self, token_ids: list[int]) -> bool:
        return all(self.m.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class _LlgMatcher(_NativeMatcher):   # llguidance.LLMatcher
    def accept(self, token_ids: list[int]) -> bool:
        return all(self.m.consume_token(t) for t in token_ids) and not self.m.is_error()

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


class Backend(ABC):
    name: str

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher: ...

    @abstractmethod
    def fill_bitmask(self, matchers: list[Matcher], rows: list[int], bitmask: torch.Tensor) -> None: ...


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals (the same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# ---- xgrammar ----

MAX_WHITESPACE = 16   # longest run of JSON whitespace between two tokens


class XgrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # our manager caches compiled grammars by key; xgrammar's own cache would only hold a second copy
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")

    def compile(self, kind: str, spec: str) -> Any:
        c, nows = self.compiler, spec.startswith("nows:")
        spec = spec.removeprefix("nows:")
        try:
            # Whitespace runs are bounded: small models otherwise pick blank lines until max_tokens (enough for
            # indented output up to ~7 levels deep).
            ws = {"any_whitespace": not nows, "max_whitespace_cnt": None if nows else MAX_WHITESPACE}
            if kind == "json_object":   # any JSON object (OpenAI's JSON mode)
                return c.compile_json_schema(spec, strict_mode=False, **ws)
            if kind == "json":   # strict mode (vLLM's default): no keys or items beyond the schema's
                return c.compile_json_schema(spec, **ws)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(json.loads(spec)))
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                return self._structural_tag(json.loads(spec))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:   # xgrammar reports bad input as RuntimeError
            raise ValueError(_short(e)) from None
        raise ValueError(f"unknown structured output kind {kind!r}")

    def _structural_tag(self, tag: dict) -> Any:
        if not isinstance(tag, dict):
            raise ValueError("structural_tag must be a JSON object")
        if "structures" in tag:   # vLLM's original shape: {"structures": [{"begin", "schema", "end"}], "triggers"}
            items = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, list(tag["triggers"]))
        return self.compiler.compile_structural_tag(json.dumps(tag))   # xgrammar's {"type": "structural_tag", "format"}

    def matcher(self, compiled: Any) -> Matcher:
        return _XgrMatcher(self.xgr.GrammarMatcher(compiled, max_rollback_tokens=-1))

    def fill_bitmask(self, matchers: list[Matcher], rows: list[int], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask, indices=rows)


# ---- llguidance ----

class GuidanceBackend(Backend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids[0])
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec: str) -> Any:
        nows = spec.startswith("nows:")
        spec = spec.removeprefix("nows:")
        fmt = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}.get(kind)
        if fmt is None:
            raise ValueError(f"the llguidance backend does not support {kind}")
        if kind in ("json", "json_object"):
            schema = json.loads(spec)
            # llguidance's own JSON options; without free whitespace, xgrammar's separators (", " and ": ")
            opts = {"whitespace_flexible": not nows, "item_separator": ", ", "key_separator": ": "}
            spec = json.dumps({**schema, "x-guidance": opts} if isinstance(schema, dict) else schema)
        try:
            grammar = self.llg.grammar_from(fmt, spec)
        except ValueError as e:
            raise ValueError(_short(e)) from None
        probe = self.llg.LLMatcher(self.tokenizer, grammar)   # compiles; errors surface as is_error()
        if probe.is_error():
            raise ValueError(_short(probe.get_error()))
        return grammar

    def matcher(self, compiled: Any) -> Matcher:
        return _LlgMatcher(self.llg.LLMatcher(self.tokenizer, compiled))

    def fill_bitmask(self, matchers: list[Matcher], rows: list[int], bitmask: torch.Tensor) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m.m, r) for m, r in zip(matchers, rows)],
                                                     bitmask)


BACKENDS: dict[str, type[Backend]] = {"xgrammar": XgrammarBackend, "llguidance": GuidanceBackend}

# JSON Schema keywords xgrammar compiles but does not enforce, and llguidance does: "auto" sends such schemas there.
XGRAMMAR_UNENFORCED = frozenset({"allOf"})


def uses_keywords(schema: Any, keywords: frozenset[str]) -> bool:
    todo = [schema]
    while todo:
        s = todo.pop()
        if isinstance(s, dict):
            if keywords & s.keys():
                return True
            todo += s.values()
        elif isinstance(s, list):
            todo += s
    return False


_CPP_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


def _short(e: Any) -> str:
    """The reason only (xgrammar's messages start with a time stamp and a C++ source location)."""
    return _CPP_LOCATION.sub("", str(e).strip())[:500]
