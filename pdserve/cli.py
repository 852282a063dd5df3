"""`pdserve` command line: one entry point, one subcommand per component.

Each component owns its flags in its own module, exposing ``add_parser(subparsers)`` which registers the subcommand
and sets ``func`` (called with the parsed namespace, returning an exit code). Modules are imported lazily by name so
``pdserve router --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve import __version__

# subcommand -> module providing add_parser(subparsers)
SUBCOMMANDS = {
    "serve": "pdserve.runtime.cli",
    "router": "pdserve.router.cli",
    "operator": "pdserve.operator.cli",
    "up": "pdserve.up",
}

SUMMARIES = {
    "serve": "run one runtime pod: an OpenAI-compatible server on the paged-KV engine (role both|prefill|decode)",
    "router": "run the prefix- and load-aware OpenAI proxy that orchestrates prefill -> decode",
    "operator": "run the Kubernetes operator reconciling InferenceService resources",
    "up": "start a router, a prefill and a decode runtime on this machine, all on the default model",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Kubernetes-native LLM serving with disaggregated "
                                     "prefill and decode.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if wanted in (None, name) or wanted not in SUBCOMMANDS:
            if wanted == name:
                importlib.import_module(module).add_parser(sub)
            else:  # listed in `pdserve --help` without importing the component
                sub.add_parser(name, help=SUMMARIES[name], add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
