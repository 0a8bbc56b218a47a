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


# ----------------------------------------------------------- commands of the running daemon
# They find the daemon through <home>/api and return what its HTTP API returns; --json prints
# the API's JSON.

STOP_TIMEOUT_S = 15.0


def _daemon_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)


def _client(args: argparse.Namespace):
    from swarmd.api_client import DaemonClient

    return DaemonClient.for_home(home_from_args(args))


def _table(rows: list[list[str]], indent: str = "", right: frozenset[int] = frozenset(),
           widths: list[int] | None = None) -> str:
    """Rows as aligned columns (the first row is the header); ``right`` columns align right.

    ``widths`` (from :func:`_widths`) lines up several tables with one another."""
    widths = widths or _widths(rows)
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def _widths(rows: list[list[str]]) -> list[int]:
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    d, h, m, s = s // 86400, s % 86400 // 3600, s % 3600 // 60, s % 60
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _stage(stage: int | None) -> str:
    return "-" if stage is None else str(stage)


def cmd_status(args: argparse.Namespace):
    return _client(args).status()


def text_status(st) -> str:
    lines = [f"peer id     {st.peer_id}",
             f"swarm       {st.swarm}",
             f"version     {st.version}",
             f"state       {st.state}",
             f"stage       {'none' if st.stage is None else st.stage}",
             f"uptime      {_duration(st.uptime_s)}",
             f"connected   {st.connected_peers} peer{'' if st.connected_peers == 1 else 's'}",
             f"throughput  {_rate(st.throughput)} samples/s",
             f"queue       {st.queue}"]
    if st.counters:
        width = max(len(name) for name in st.counters)
        for i, (name, value) in enumerate(sorted(st.counters.items())):
            lines.append(f"{'counters' if i == 0 else '':<12}{name:<{width}}  {value}")
    else:
        lines.append("counters    (none)")
    return "\n".join(lines)


def cmd_peers(args: argparse.Namespace):
    return _client(args).peers()


def text_peers(peers) -> str:
    if not peers:
        return "no connected peers"
    rows = [["PEER ID", "STAGE", "STATE"]]
    rows += [[p.peer_id, _stage(p.stage), p.state or "-"]
             for p in sorted(peers, key=lambda p: (p.stage is None, p.stage or 0, p.peer_id))]
    return _table(rows) + f"\n{len(peers)} connected peer{'' if len(peers) == 1 else 's'}"


def cmd_swarm(args: argparse.Namespace):
    return _client(args).swarm()


def text_swarm(sw) -> str:
    head = (f"swarm {sw.swarm}: {sw.num_stages} stage{'' if sw.num_stages == 1 else 's'}, "
            f"{sw.peers_total} peer{'' if sw.peers_total == 1 else 's'}")
    if sw.bottleneck is not None:
        slowest = next((s for s in sw.stages if s.stage == sw.bottleneck), None)
        rate = f" ({_rate(slowest.total_throughput)} samples/s)" if slowest else ""
        head += f"; bottleneck: stage {sw.bottleneck}{rate}"
    header = ["PEER ID", "STATE", "STEP", "SAMPLES/S", "QUEUE", "AGE", "NOTE"]
    tables = [[header] + [[p.peer_id, p.state, str(p.step), _rate(p.throughput), str(p.queue),
                           f"{p.age_s:.1f}s",
                           "" if p.routable else f"not routed: {p.reason or 'no reason given'}"]
                          for p in row.peers]
              for row in sw.stages]
    widths = _widths([line for table in tables for line in table]) if tables else None
    blocks = [head]
    for row, table in zip(sw.stages, tables):
        mark = "   <== BOTTLENECK" if row.stage == sw.bottleneck else ""
        lines = [f"stage {row.stage}  {_rate(row.total_throughput)} samples/s  "
                 f"{row.routable_peers} of {len(row.peers)} peer"
                 f"{'' if len(row.peers) == 1 else 's'} routable{mark}"]
        if row.peers:
            lines.append(_table(table, indent="  ", right=frozenset({2, 3, 4, 5}),
                                widths=widths))
        else:
            lines.append("  (no peers)")
        blocks.append("\n".join(lines))
    if not sw.stages:
        blocks.append("no stages known yet")
    if sw.excluded:
        rows = [["PEER ID", "STATE", "STAGE", "REASON"]]
        rows += [[p.peer_id, p.state, _stage(p.stage), p.reason or "no reason given"]
                 for p in sw.excluded]
        blocks.append(f"excluded from routing ({len(sw.excluded)}):\n"
                      + _table(rows, indent="  "))
    return "\n\n".join(blocks)


@dataclass(frozen=True)
class StopResult:
    #: the daemon's HTTP API
    url: str
    #: True: the daemon removed its api file (it has exited)
    stopped: bool


def _stop_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    parser.add_argument("--timeout", metavar="SECONDS", type=float, default=STOP_TIMEOUT_S,
                        help=f"how long to wait for the daemon to exit (default "
                             f"{STOP_TIMEOUT_S:g})")


def cmd_stop(args: argparse.Namespace) -> StopResult:
    from swarmd.api_client import api_file_path, wait_gone
    from swarmd.api_token import read_token
    from swarmd.errors import DaemonReplyError

    home = home_from_args(args)
    client = _client(args)
    client.stop(read_token(home))
    if not wait_gone(api_file_path(home), args.timeout):
        raise DaemonReplyError(
            f"the daemon at {client.url} accepted the stop request but has not exited within "
            f"{args.timeout:g} s ({api_file_path(home)} is still there): wait a little and run "
            f"`swarmd status --home {home}`; if it hangs, stop it with Ctrl-C or `kill`")
    return StopResult(url=client.url, stopped=True)


def text_stop(result: StopResult) -> str:
    return "stopped"


# ------------------------------------------------------------------------------------- join

def configure_logging(level: str) -> None:
    """Log to stderr at ``level``. Imports libp2p first: importing it resets its logger, so
    logging configured before that import would be undone."""
    import logging

    import libp2p  # noqa: F401

    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _join_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    add_config_argument(parser)
    parser.add_argument("--listen", metavar="MULTIADDR", action="append",
                        help="libp2p listen address, repeatable (overrides network.listen)")
    parser.add_argument("--bootstrap", metavar="MULTIADDR", action="append",
                        help="peer to join through, .../p2p/<id>, repeatable (overrides "
                             "network.bootstrap); none starts a new swarm")
    parser.add_argument("--http", metavar="HOST:PORT",
                        help="local HTTP API address (overrides http.listen; port 0 picks one)")
    parser.add_argument("--stage", metavar="N|auto", default="auto",
                        help="pipeline stage to serve, or auto (the bottleneck stage)")


@dataclass(frozen=True)
class JoinResult:
    peer_id: str
    stopped: bool


def cmd_join(args: argparse.Namespace) -> JoinResult:

    from swarmd.daemon import JoinOptions, Started, run_join
    from swarmd.errors import ConfigError

    overrides: dict[str, Any] = {"network.listen": args.listen, "network.bootstrap": args.bootstrap,
                                 "http.listen": args.http}
    config = config_from_args(args, overrides)
    if args.stage == "auto":
        stage = None
    else:
        try:
            stage = int(args.stage)
            if stage < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"command line flag --stage: {args.stage!r} is invalid; expected a "
                              f"stage number (0, 1, ...) or auto") from None
    configure_logging(config.log.level.upper())
    options = JoinOptions(home=home_from_args(args), config=config, stage=stage)
    started: list[Started] = []

    def on_started(info: Started) -> None:
        started.append(info)
        if args.json:
            print(json.dumps(to_jsonable(info)), flush=True)
        else:
            print(f"peer id   {info.peer_id}")
            for addr in info.addrs:
                print(f"listening {addr}")
            print(f"http      {info.http_url}", flush=True)

    run_join(options, on_started)
    return JoinResult(peer_id=started[0].peer_id if started else "", stopped=True)


def text_join(result: JoinResult) -> str:
    return "stopped"


# ------------------------------------------------------------------------------- train, demo

def _train_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    add_config_argument(parser)
    parser.add_argument("--bootstrap", metavar="MULTIADDR", action="append",
                        help="a peer of the swarm, .../p2p/<id>, repeatable (overrides "
                             "network.bootstrap)")
    parser.add_argument("--data", metavar="PATH", type=Path,
                        help="a text file or a directory tree (default: data.path, else the "
                             "Python standard library's sources)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--listen", metavar="MULTIADDR", action="append",
                        help="where stage peers reach this trainer (default: 127.0.0.1, any "
                             "port)")


def cmd_train(args: argparse.Namespace) -> Any:
    import uvloop

    from swarmd.errors import ConfigError
    from swarmd.train_run import train

    if args.steps < 1:
        raise ConfigError("command line flag --steps: must be at least 1")
    config = config_from_args(args, {"network.bootstrap": args.bootstrap})
    if not config.network.bootstrap:
        raise ConfigError("swarmd train needs a swarm to join: pass --bootstrap "
                          "/ip4/HOST/tcp/PORT/p2p/PEER_ID (a running daemon's address, see "
                          "`swarmd id`)")
    configure_logging(config.log.level.upper())
    home = home_from_args(args)
    home.mkdir(parents=True, exist_ok=True)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    return uvloop.run(train(config, bootstrap=config.network.bootstrap, steps=args.steps,
                            data_path=args.data, home=home,
                            listen=args.listen or ("/ip4/127.0.0.1/tcp/0",), progress=say))


def text_train(result: Any) -> str:
    return (f"trained {result.steps} steps: validation loss {result.initial_val_loss:.4f} -> "
            f"{result.final_val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s, rerouted "
            f"{result.rerouted}, restarted {result.restarted}, lost {result.lost}")


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=2, help="daemons to start (default 2)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150)")


def cmd_demo(args: argparse.Namespace) -> Any:

    from swarmd.demo import run_demo
    from swarmd.errors import ConfigError

    configure_logging("WARNING")
    if args.steps < 1 or args.stages < 1 or args.peers < args.stages:
        raise ConfigError("swarmd demo needs --steps >= 1, --stages >= 1 and at least one peer "
                          "per stage (--peers >= --stages)")
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else \
        (lambda line: print(line, flush=True))
    result = run_demo(peers=args.peers, stages=args.stages, steps=args.steps, progress=say)
    if not result.final_val_loss < result.initial_val_loss:
        print(text_demo(result), file=sys.stderr)
        raise _DemoFailed("validation loss did not go down")
    return result


class _DemoFailed(SwarmdError):
    code = "demo_failed"


def text_demo(result: Any) -> str:
    drop = 1 - result.final_val_loss / result.initial_val_loss
    return (f"demo: {result.peers} peers, {result.stages} stages, {result.steps} steps in "
            f"{result.seconds:.0f} s\nvalidation loss {result.initial_val_loss:.4f} -> "
            f"{result.final_val_loss:.4f} ({drop:.0%} lower), {result.tokens_per_s:,.0f} "
            f"tokens/s\nrerouted {result.rerouted}, restarted {result.restarted}, lost "
            f"{result.lost}")


COMMANDS: list[Command] = [
    Command("init", "create the home directory, identity key and config file",
            _init_arguments, cmd_init, text_init,
            description="Create the home directory (mode 0700) with a new identity key and a "
                        "documented config.toml. Running it again keeps the existing identity "
                        "and config."),
    Command("id", "print this node's peer id and listen addresses",
            _id_arguments, cmd_id, text_id),
    Command("join", "run the daemon: join (or start) a swarm and serve a stage",
            _join_arguments, cmd_join, text_join,
            description="Run the swarmd daemon in the foreground until SIGINT/SIGTERM or "
                        "`swarmd stop`. With no bootstrap address it starts a new swarm. Prints "
                        "its peer id, listen addresses (with /p2p/<id>) and HTTP URL once they "
                        "are bound; writes <home>/api then, and removes it on exit."),
    Command("train", "train the model through a running swarm",
            _train_arguments, cmd_train, text_train,
            description="Join the swarm at --bootstrap as a trainer and train the model through "
                        "its stages: byte-level data from --data (default: the Python standard "
                        "library's sources), a held-out validation split, progress with loss, "
                        "tokens/s and route statistics, metrics appended to "
                        "<home>/train-metrics.jsonl."),
    Command("demo", "start a local swarm, train it, and show the result",
            _demo_arguments, cmd_demo, text_demo,
            description="Start --peers daemons on 127.0.0.1 serving --stages stages, train "
                        "--steps steps through them, shut everything down and print a summary "
                        "(with --json, the last line is one JSON object). Exits non-zero if "
                        "the validation loss did not go down."),
    Command("status", "print the running daemon's state, stage, throughput and counters",
            _daemon_arguments, cmd_status, text_status,
            description="Ask the daemon running for this home (found through <home>/api) for "
                        "its status: peer id, lifecycle state, stage, uptime, throughput, queue "
                        "and counters. --json prints GET /api/v0/status."),
    Command("peers", "list the peers the running daemon is connected to",
            _daemon_arguments, cmd_peers, text_peers,
            description="List the libp2p peers the running daemon is connected to, with the "
                        "stage and state they announced. --json prints GET /api/v0/peers."),
    Command("swarm", "show the pipeline as the running daemon sees it",
            _daemon_arguments, cmd_swarm, text_swarm,
            description="Show the swarm as the running daemon sees it: each stage with its "
                        "total throughput and peers, the bottleneck stage, and the peers kept "
                        "out of routing with the reason. --json prints GET /api/v0/swarm."),
    Command("stop", "stop the running daemon gracefully",
            _stop_arguments, cmd_stop, text_stop,
            description="Ask the daemon running for this home to shut down (with the token in "
                        "<home>/api_token) and wait until it has exited."),
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
