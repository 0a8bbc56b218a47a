"""Commands that run here: ``init`` and ``id`` (the home), ``join``, ``train`` and ``demo``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.cli.common import (add_config_argument, add_home_argument, config_from_args,
                               configure_logging, home_from_args, to_jsonable)
from swarmd.errors import SwarmdError


def _init_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)


def cmd_init(args: argparse.Namespace):
    from swarmd.node.home import init_home

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
    from swarmd.node.home import load_identity

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

    from swarmd.node.daemon import JoinOptions, Started, run_join
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
    configure_logging(config.log.level.upper(), config.log)
    options = JoinOptions(home=home_from_args(args), config=config, stage=stage)
    started: list[Started] = []

    def on_started(info: Started) -> None:
        from swarmd.node.logs import json_mode, set_peer_id

        set_peer_id(info.peer_id)
        started.append(info)
        if args.json:
            print(json.dumps(to_jsonable(info)), flush=True)
        elif json_mode():  # the banner as a record (stderr and log.file, like every record)
            logging.getLogger("swarmd.cli").info(
                "started: peer id %s, http %s", info.peer_id, info.http_url,
                extra={"event": "started", "peer_id": info.peer_id,
                       "addrs": list(info.addrs), "http": info.http_url})
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
                        help="text, JSONL or Parquet files or a directory tree of them, or "
                             "a datasets save_to_disk directory (default: data.path, else "
                             "the Python standard library's sources; docs/data.md)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--listen", metavar="MULTIADDR", action="append",
                        help="where stage peers reach this trainer (default: 127.0.0.1, any "
                             "port)")


def cmd_train(args: argparse.Namespace) -> Any:
    import uvloop

    from swarmd.errors import ConfigError
    from swarmd.trainer.run import train

    if args.steps < 1:
        raise ConfigError("command line flag --steps: must be at least 1")
    config = config_from_args(args, {"network.bootstrap": args.bootstrap})
    if not config.network.bootstrap:
        raise ConfigError("swarmd train needs a swarm to join: pass --bootstrap "
                          "/ip4/HOST/tcp/PORT/p2p/PEER_ID (a running daemon's address, see "
                          "`swarmd id`)")
    configure_logging(config.log.level.upper(), config.log)
    home = home_from_args(args)
    home.mkdir(parents=True, exist_ok=True)
    return uvloop.run(train(config, bootstrap=config.network.bootstrap, steps=args.steps,
                            data_path=args.data, home=home,
                            listen=args.listen or ("/ip4/127.0.0.1/tcp/0",),
                            progress=_progress(args)))


def text_train(result: Any) -> str:
    return (f"trained {result.steps} steps: validation loss {result.initial_val_loss:.4f} -> "
            f"{result.final_val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s, rerouted "
            f"{result.rerouted}, restarted {result.restarted}, lost {result.lost}")


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=2, help="daemons to start (default 2)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    parser.add_argument("--model", metavar="DIR", type=Path,
                        help="a Hugging Face model directory (config.json, optionally "
                             "*.safetensors and tokenizer.json) to train instead of the "
                             "built-in GPT")
    parser.add_argument("--data", metavar="PATH", type=Path,
                        help="text, JSONL or Parquet to train on (default: the Python "
                             "standard library's sources)")


def cmd_demo(args: argparse.Namespace) -> Any:

    from swarmd.local.demo import run_demo
    from swarmd.errors import ConfigError

    configure_logging("WARNING", _demo_log())
    if args.steps < 1 or args.stages < 1 or args.peers < args.stages:
        raise ConfigError("swarmd demo needs --steps >= 1, --stages >= 1 and at least one peer "
                          "per stage (--peers >= --stages)")
    result = run_demo(peers=args.peers, stages=args.stages, steps=args.steps,
                      model=args.model, data=args.data, progress=_progress(args))
    if not result.final_val_loss < result.initial_val_loss:
        _progress(args)(text_demo(result))
        raise _DemoFailed("validation loss did not go down")
    return result


def _progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Where a command's progress lines go: log records in json mode, stderr beside a
    ``--json`` result, else stdout."""
    from swarmd.node.logs import json_mode

    if json_mode():
        log = logging.getLogger("swarmd.cli")
        return lambda line: log.info(line, extra={"event": "progress"})
    if args.json:
        return lambda line: print(line, file=sys.stderr, flush=True)
    return lambda line: print(line, flush=True)


def _demo_log() -> Any:
    """The demo's ``[log]``: ``log.format`` from the environment (the demo has no config
    file), at level warning, to stderr only (its daemons log to their own stderr files)."""
    import os

    from swarmd.config import load_config

    return dataclasses.replace(load_config(None, os.environ, {}).log, level="warning", file="")


class _DemoFailed(SwarmdError):
    code = "demo_failed"


def text_demo(result: Any) -> str:
    drop = 1 - result.final_val_loss / result.initial_val_loss
    return (f"demo: {result.peers} peers, {result.stages} stages, {result.steps} steps in "
            f"{result.seconds:.0f} s\nvalidation loss {result.initial_val_loss:.4f} -> "
            f"{result.final_val_loss:.4f} ({drop:.0%} lower), {result.tokens_per_s:,.0f} "
            f"tokens/s\nrerouted {result.rerouted}, restarted {result.restarted}, lost "
            f"{result.lost}")
