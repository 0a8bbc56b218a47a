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
import json
import logging
import sys
from collections.abc import Sequence

from swarmd.version import __version__
from swarmd.cli.client import (_daemon_arguments, _stop_arguments, cmd_peers, cmd_status,
                               cmd_stop, cmd_swarm, text_peers, text_status, text_stop,
                               text_swarm)
from swarmd.cli.common import PROG, Command, asked_log_format, to_jsonable
from swarmd.cli.doctor import _doctor_arguments, cmd_doctor, text_doctor
from swarmd.cli.export import (_export_arguments, _sample_arguments, cmd_export, cmd_sample,
                               text_export, text_sample)
from swarmd.cli.service import _service_arguments, cmd_service, text_service
from swarmd.cli.local import (_demo_arguments, _id_arguments, _init_arguments,
                              _join_arguments, _train_arguments, cmd_demo, cmd_id, cmd_init,
                              cmd_join, cmd_train, text_demo, text_id, text_init, text_join,
                              text_train)
from swarmd.cli.tokenizer import _tokenizer_arguments, cmd_tokenizer, text_tokenizer
from swarmd.errors import SwarmdError
from transport.errors import IdentityError



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
                        "are bound; writes <home>/api then, and removes it on exit. With "
                        "log.format = \"json\" every line it writes is one JSON object: the "
                        "banner is a record with peer_id, addrs and http.",
            log_format=True),
    Command("train", "train the model through a running swarm",
            _train_arguments, cmd_train, text_train,
            description="Join the swarm at --bootstrap as a trainer and train the model through "
                        "its stages: data from --data (default: the Python standard library's "
                        "sources), tokenized once, held out by document, shuffled and sharded "
                        "between trainers (docs/data.md); progress with loss, tokens/s and "
                        "route statistics, metrics and validation losses appended to "
                        "<home>/train-metrics.jsonl.",
            log_format=True),
    Command("demo", "start a local swarm, train it, and show the result",
            _demo_arguments, cmd_demo, text_demo,
            description="Start --peers daemons on 127.0.0.1 serving --stages stages, train "
                        "--steps steps through them, shut everything down and print a summary "
                        "(with --json, the last line is one JSON object). Exits non-zero if "
                        "the validation loss did not go down.",
            log_format=True),
    Command("export", "download a swarm's model into a directory transformers or swarmd loads",
            _export_arguments, cmd_export, text_export,
            description="Join the swarm at --bootstrap (or through the daemon running with "
                        "--home) as a client, download every stage's weights from its peers "
                        "at one step (checked against the round digest they report) and the "
                        "embedding and head from a trainer, and write --out: for a Hugging "
                        "Face model a directory AutoModelForCausalLM.from_pretrained loads "
                        "(config.json, sharded safetensors, the tokenizer files, "
                        "generation_config.json), for the built-in GPT safetensors and a "
                        "config.toml; swarmd-export.json says where each part came from. "
                        "Nothing is left in --out when it fails."),
    Command("sample", "generate text from an exported model",
            _sample_arguments, cmd_sample, text_sample,
            description="Continue --prompt with --max-new-tokens tokens of a model written by "
                        "`swarmd export` (transformers' generate for a Hugging Face model, a "
                        "sampling loop for the built-in GPT) and print the prompt and the "
                        "text."),
    Command("tokenizer", "train a BPE tokenizer on local data",
            _tokenizer_arguments, cmd_tokenizer, text_tokenizer,
            description="`swarmd tokenizer train --data PATH --vocab N --out DIR` trains a "
                        "byte-level BPE tokenizer (the tokenizers library) on the text, JSONL "
                        "or Parquet files at PATH and writes DIR/tokenizer.json, with "
                        "<|endoftext|> as token 0; point data.tokenizer at it."),
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
    Command("doctor", "check what could stop this machine from joining a swarm",
            _doctor_arguments, cmd_doctor, text_doctor,
            description="Check Python, torch and the device, the config (and what differs from "
                        "the defaults), the home, each bootstrap address (reachable, same swarm, "
                        "same model, clock), with what to do for each problem. Exits 1 when "
                        "something blocks joining."),
    Command("service", "install or remove a systemd unit that keeps the daemon running",
            _service_arguments, cmd_service, text_service,
            description="install writes a systemd unit running `swarmd join --home HOME` as you "
                        "(restarted on failure with a growing delay) and prints how to enable "
                        "it; uninstall removes it. --user: a user unit, no root needed."),
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


def _json_mode() -> bool:
    from swarmd.node import logs

    return logs.json_mode()


def _error(message: str, command: Command | None = None, args: argparse.Namespace | None = None,
           code: str = "error") -> None:
    """One line on stderr; a JSON log record when the command writes in json mode."""
    from swarmd.node import logs

    if _json_mode() or (command is not None and command.log_format
                        and asked_log_format(args) == "json"):
        print(logs.json_line("swarmd", logging.ERROR, message, event="error", code=code),
              file=sys.stderr, flush=True)
    else:
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
        _error(str(exc), command, args, exc.code)
        return exc.exit_status
    except IdentityError as exc:
        _error(str(exc), command, args, "identity")
        return 1
    except OSError as exc:
        _error(str(exc), command, args, "os")
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(to_jsonable(result)))
    elif command.log_format and _json_mode():
        logging.getLogger("swarmd.cli").info(command.text(result), extra={
            "event": f"{command.name}_result", "result": to_jsonable(result)})
    else:
        print(command.text(result))
    status = getattr(result, "exit_status", 0)  # a command that reports a failing verdict
    return status if isinstance(status, int) else 0
