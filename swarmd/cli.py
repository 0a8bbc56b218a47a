"""The ``swarmd`` command line.

Each command is a :class:`Command`: a function that takes the parsed arguments and returns a
typed value (a dataclass), and a function that renders that value as text. With ``--json`` the
value is printed as one JSON object instead. Adding a command means writing those two
functions and one entry in :data:`COMMANDS`; nothing else here changes.

Errors: a :class:`swarmd.errors.SwarmdError` or ``transport.errors.IdentityError`` ends the
command with one line ``swarmd: error: ...`` on stderr and the error's exit status (2 for
configuration and usage, 1 otherwise), never a traceback.

Importing this module (``--version``, ``--help``) imports neither libp2p nor torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd import __version__
from swarmd.errors import SwarmdError
from transport.errors import IdentityError

PROG = "swarmd"


@dataclass(frozen=True)
class Command:
    name: str
    #: one line, shown in ``swarmd --help``
    help: str
    #: adds the command's own options to its subparser
    add_arguments: Callable[[argparse.ArgumentParser], None]
    #: does the work, returns a dataclass
    run: Callable[[argparse.Namespace], Any]
    #: renders the result for people
    text: Callable[[Any], str]
    description: str | None = None


# ------------------------------------------------------------------------------ shared options

def add_home_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", metavar="DIR",
                        help="home directory (default: $SWARMD_HOME, else ~/.swarmd)")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", type=Path,
                        help="TOML config file (default: <home>/config.toml if present)")


def home_from_args(args: argparse.Namespace) -> Path:
    from swarmd.home import resolve_home

    return resolve_home(getattr(args, "home", None), os.environ)


def config_from_args(args: argparse.Namespace, overrides: dict[str, Any] | None = None):
    """The configuration: ``--config`` or ``<home>/config.toml``, environment, then ``overrides``."""
    from swarmd.config import load_config
    from swarmd.home import home_config_path

    path = getattr(args, "config", None)
    if path is None:
        path = home_config_path(home_from_args(args))
    return load_config(path, os.environ, overrides or {})


# ------------------------------------------------------------------------------------ commands

def _init_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)


def cmd_init(args: argparse.Namespace):
    from swarmd.home import init_home

    return init_home(home_from_args(args))


def text_init(result) -> str:
    ident = "created new" if result.identity_created else "kept existing"
    conf = "created" if result.config_created else "kept existing"
    return (f"home      {result.home}\n"
            f"identity  {result.peer_id} ({ident}, {result.key_path})\n"
            f"config    {result.config_path} ({conf})")


@dataclass(frozen=True)
class IdResult:
    peer_id: str
    #: the configured listen multiaddrs
    addrs: list[str]


def _id_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    add_config_argument(parser)


def cmd_id(args: argparse.Namespace) -> IdResult:
    from swarmd.home import load_identity

    config = config_from_args(args)
    identity = load_identity(home_from_args(args))
    return IdResult(peer_id=identity.peer_id, addrs=list(config.network.listen))


def text_id(result: IdResult) -> str:
    lines = [f"peer id  {result.peer_id}"]
    lines += [f"listen   {addr}" for addr in result.addrs] or ["listen   (none)"]
    return "\n".join(lines)


COMMANDS: list[Command] = [
    Command("init", "create the home directory, identity key and config file",
            _init_arguments, cmd_init, text_init,
            description="Create the home directory (mode 0700) with a new identity key and a "
                        "documented config.toml. Running it again keeps the existing identity "
                        "and config."),
    Command("id", "print this node's peer id and listen addresses",
            _id_arguments, cmd_id, text_id),
]


# ---------------------------------------------------------------------------------- plumbing

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="SWARM-parallel training over libp2p, as a daemon.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help,
                           description=command.description or command.help[:1].upper()
                           + command.help[1:] + ".")
        command.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")
        p.set_defaults(_command=command)
    return parser


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (argparse printed them)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    command: Command | None = getattr(args, "_command", None)
    if command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        result = command.run(args)
    except SwarmdError as exc:
        _error(str(exc))
        return exc.exit_status
    except IdentityError as exc:
        _error(str(exc))
        return 1
    except OSError as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(to_jsonable(result)))
    else:
        print(command.text(result))
    return 0
