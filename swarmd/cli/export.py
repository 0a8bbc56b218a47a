"""``swarmd export`` (a swarm's model into a directory) and ``swarmd sample`` (text from one)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from swarmd.cli.common import (add_config_argument, add_home_argument, config_from_args,
                               configure_logging, home_from_args)


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    add_config_argument(parser)
    parser.add_argument("--bootstrap", metavar="MULTIADDR", action="append",
                        help="a peer of the swarm, .../p2p/<id>, repeatable (default: the "
                             "daemon running with --home, else network.bootstrap)")
    parser.add_argument("--out", metavar="DIR", type=Path, required=True,
                        help="directory to create (must not exist, or be empty)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="type of the weights written (default float32)")
    parser.add_argument("--trainer-home", metavar="DIR", type=Path,
                        help="take the embedding and head from the state a trainer saved in "
                             "this home (default: from a trainer training now, else from "
                             "--home's when it is a trainer's)")
    parser.add_argument("--timeout", metavar="S", type=float, default=120.0,
                        help="how long to wait for every stage at one step (default 120)")
    parser.add_argument("--any-step", action="store_true",
                        help="past --timeout, take each stage at its own step rather than fail")
    parser.add_argument("--max-shard-size", metavar="SIZE", default="50GB",
                        help='largest safetensors file, e.g. "5GB" (default 50GB, as '
                             "save_pretrained)")


def cmd_export(args: argparse.Namespace) -> Any:
    import uvloop

    from swarmd.errors import ConfigError
    from swarmd.export.client import export_from_swarm
    from swarmd.export.collect import CollectSettings

    if not args.timeout > 0:
        raise ConfigError("command line flag --timeout: must be greater than 0")
    config = config_from_args(args)
    configure_logging("WARNING")
    bootstrap = args.bootstrap or _daemon_addrs(args) or list(config.network.bootstrap)
    if not bootstrap:
        raise ConfigError("swarmd export needs a swarm to reach: pass --bootstrap "
                          "/ip4/HOST/tcp/PORT/p2p/PEER_ID, or --home of a running daemon")
    settings = CollectSettings(deadline_s=args.timeout, mixed=args.any_step)
    with _Bars() as bars:
        return uvloop.run(export_from_swarm(
            config, bootstrap=bootstrap, out=args.out, dtype=args.dtype,
            trainer_home=args.trainer_home, saved_home=_trainer_home(args), settings=settings,
            max_shard_size=_shard_size(args.max_shard_size), progress=bars.update,
            say=lambda line: print(line, file=sys.stderr)))


def _daemon_addrs(args: argparse.Namespace) -> list[str]:
    """The addresses of the daemon running with ``--home``, when one does."""
    from swarmd.api.client import DaemonClient, api_file_path
    from swarmd.errors import SwarmdError

    if args.home is None and "SWARMD_HOME" not in os.environ:
        return []
    home = home_from_args(args)
    if not api_file_path(home).exists():
        return []
    try:
        return list(DaemonClient.for_home(home).id_info().addrs)
    except SwarmdError:
        return []


def _trainer_home(args: argparse.Namespace) -> Path | None:
    """``--home``, when it is a trainer's (its saved state is the parts' last resort)."""
    from swarmd.state.trainer_state import state_path

    if args.home is None and "SWARMD_HOME" not in os.environ:
        return None
    home = home_from_args(args)
    return home if state_path(home).is_file() else None


def _shard_size(text: str) -> int | str:
    import re

    from swarmd.errors import ConfigError

    value = text.strip().upper()
    if value.isdigit() and int(value) > 0:
        return int(value)
    if not re.fullmatch(r"[1-9]\d*(KB|MB|GB|TB)", value):
        raise ConfigError(f'command line flag --max-shard-size: {text!r}; expected bytes or a '
                          f'size such as "5GB" or "500MB"')
    return value


class _Bars:
    """A byte progress bar per part on stderr, when that is a terminal."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.part: str | None = None

    def __enter__(self) -> _Bars:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, part: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if part != self.part or self.bar is None or self.bar.total != total:
            if self.bar is not None:
                self.bar.close()
            self.part = part
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=part,
                            file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)


def text_export(result: Any) -> str:
    step = f"step {result.step}" if result.step is not None else "a mixed cut (steps below)"
    lines = [f"exported {'a Hugging Face model' if result.kind == 'hf' else 'the built-in GPT'}"
             f" at {step} to {result.out} ({result.dtype}, {len(result.files)} files, "
             f"{result.bytes / 1e6:.1f} MB, {result.seconds:.1f} s)"]
    for p in result.parts:
        extra = (f", trainer step {p.trainer_step}"
                 if p.trainer_step is not None and p.trainer_step != p.step else "")
        kind = "round" if p.part == "trainers" else "step"
        check = "round digest matched" if p.verified else "round digest not compared"
        lines.append(f"  {p.part:<9} {kind} {p.step}{extra} from {p.source} ({check})")
    return "\n".join(lines)


def _sample_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", type=Path, required=True,
                        help="a directory written by `swarmd export`")
    parser.add_argument("--prompt", default="", help="text to continue (default: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0: the likeliest token each time "
                             "(default 0.8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")


def cmd_sample(args: argparse.Namespace) -> Any:
    from swarmd.export.sample import sample

    configure_logging("WARNING")
    return sample(args.model, args.prompt, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, seed=args.seed)


def text_sample(result: Any) -> str:
    return result.prompt + result.text
