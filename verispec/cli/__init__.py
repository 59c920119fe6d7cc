"""The ``verispec`` command.

One module per sub-command in this package; each exposes ``register(subparsers)`` which adds its
parser and sets ``run`` (a function of the parsed arguments returning the exit status).

Exit statuses: 0 success; 1 the command ran but its verdict is negative (a certification failed);
2 bad input (one line on stderr, no traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Sequence
from typing import NoReturn

from verispec.errors import ConfigError, VerispecError

# Sub-command modules, in the order `verispec --help` lists them.
COMMAND_MODULES = ("generate", "serve", "bench", "loadgen", "gate", "analyze", "certify", "train", "models", "doctor")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from verispec import __version__

    parser = OneLineParser(
        prog="verispec",
        description="Speculative decoding that keeps the target model's output distribution exactly, "
        "measured against its peers.",
    )
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"verispec.cli.{name}")
        module.register(sub)
    return parser


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, before any work, option values no command can mean: NaN or infinite floats and
    integers beyond 64 bits (a single value or a comma-separated list). Ranges of particular
    options are checked where they are used (SamplingParams, EngineConfig, ServerConfig)."""
    for name, value in vars(args).items():
        for item in value if isinstance(value, list | tuple) else [value]:
            option = "--" + name.replace("_", "-")
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{option} must be a finite number, got {item}", param=name)
            if isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**64:
                raise ConfigError(f"{option} = {item} is beyond 64 bits", param=name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        check_numbers(args)
        status: int = run(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
