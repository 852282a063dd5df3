"""A small Dockerfile parser for the static image checks: logical instructions (continuations joined, comment lines
dropped, as BuildKit does), their leading ``--flags``, exec-form JSON arguments, ENV/ARG pairs, grouped by stage."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

KNOWN = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER", "WORKDIR",
         "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}
_FLAG = re.compile(r"--([a-z-]+)(?:=(\S+))?\s+")


@dataclass(frozen=True)
class Instruction:
    cmd: str                     # upper-case keyword
    args: str                    # the text after the keyword and its flags
    flags: dict[str, str]        # --from=builder, --mount=type=cache,... (a repeated flag keeps the last)
    line: int                    # first physical line, 1-based

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/RUN/VOLUME, else None."""
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None

    def pairs(self) -> dict[str, str | None]:
        """ENV/ARG/LABEL ``k=v`` pairs (an ARG without a default maps to None; legacy ``ENV k v`` supported)."""
        words = shlex.split(self.args)
        if self.cmd == "ENV" and words and "=" not in words[0]:
            return {words[0]: " ".join(words[1:])}
        return {k: (v if sep else None) for k, sep, v in (w.partition("=") for w in words)}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: list[Stage]

    def all(self) -> list[Instruction]:
        return [i for s in self.stages for i in s.instructions]


def _logical_lines(text: str):
    start, parts = None, []
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue                                   # comments (and directives) vanish, inside continuations too
        if start is None:
            start = n
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        yield start, " ".join(p for p in parts if p)
        start, parts = None, []
    if parts:
        yield start, " ".join(parts)


def parse(text: str) -> Dockerfile:
    """Parse a Dockerfile; an unknown keyword or an instruction before the first FROM (other than ARG) raises."""
    df = Dockerfile({}, [])
    for line, logical in _logical_lines(text):
        keyword, _, rest = logical.partition(" ")
        cmd = keyword.upper()
        if cmd not in KNOWN:
            raise ValueError(f"line {line}: unknown instruction {keyword!r}")
        flags: dict[str, str] = {}
        rest = rest.strip() + " "
        while cmd in ("FROM", "RUN", "COPY", "ADD") and (m := _FLAG.match(rest)):
            flags[m[1]] = m[2] or ""
            rest = rest[m.end():]
        instr = Instruction(cmd, rest.strip(), flags, line)
        if cmd == "FROM":
            words = instr.args.split()
            df.stages.append(Stage(words[0], words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
        elif not df.stages:
            if cmd != "ARG":
                raise ValueError(f"line {line}: {cmd} before the first FROM")
            df.global_args.update(instr.pairs())
        else:
            df.stages[-1].instructions.append(instr)
    return df
