"""The `kvswitch` command: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their subcommand is chosen, so `kvswitch engine` never pays for
Envoy or matplotlib imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says its default or
    there is none to show (None: "unset", which the help or its group explains)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvswitch.up", "start Envoy, the endpoint picker, the frontend and simulated engines"),
    "engine": ("kvswitch.engine.cli", "serve the vLLM gRPC engine API (simulated model server)"),
    "epp": ("kvswitch.epp.cli", "run the endpoint picker (Envoy ext_proc server)"),
    "frontend": ("kvswitch.frontend.cli", "serve the OpenAI API and call a vLLM gRPC target"),
    "envoy-config": ("kvswitch.envoy", "write the Envoy bootstrap for a pool and an EPP"),
    "bench": ("kvswitch.bench.cli", "benchmark kvswitch against round robin, an oracle and peers"),
}


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvswitch",
        description="kvswitch: a prefix-cache-aware inference gateway for vLLM gRPC fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(args_list)
    result: int = args._run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
