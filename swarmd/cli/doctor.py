"""``swarmd doctor``: checks with a verdict and what to do (swarmd.node.doctor)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from swarmd.cli.common import add_config_argument, add_home_argument, config_from_args, home_from_args


def _doctor_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    add_config_argument(parser)
    parser.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                        help="check this bootstrap address instead of network.bootstrap "
                             "(repeatable)")


@dataclass(frozen=True)
class DoctorResult:
    checks: tuple[dict[str, str], ...]
    #: 1 when something blocks joining (a "fail"), else 0
    exit_status: int


def cmd_doctor(args: argparse.Namespace) -> DoctorResult:
    from swarmd.node import doctor

    overrides = {"network.bootstrap": args.bootstrap} if args.bootstrap else {}
    checks = doctor.check_all(home_from_args(args), lambda: config_from_args(args, overrides))
    return DoctorResult(tuple({"name": c.name, "verdict": c.verdict, "found": c.found,
                               "fix": c.fix} for c in checks), int(doctor.blocking(checks)))


def text_doctor(result: DoctorResult) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    lines = []
    for c in result.checks:
        lines.append(f"{mark.get(c['verdict'], '?   ')} {c['name']}: {c['found']}")
        if c["fix"] and c["verdict"] != "ok":
            lines.append(f"     -> {c['fix']}")
    lines.append("something blocks joining (FAIL above)" if result.exit_status
                 else "nothing blocks joining")
    return "\n".join(lines)
