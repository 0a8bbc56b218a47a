"""``python -m tools.wanlab --check | --cleanup``."""

from __future__ import annotations

import argparse
import sys

from tools.wanlab import netns
from tools.wanlab.spec import LabUnavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.wanlab")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="say whether a lab can run here")
    group.add_argument("--cleanup", action="store_true",
                       help="delete the namespaces of labs whose process died")
    args = parser.parse_args(argv)
    if args.check:
        try:
            netns.check_host(sys.executable)
        except LabUnavailable as exc:
            print(f"unavailable: {exc}")
            return 1
        print("ok: the lab can run here")
        return 0
    gone = netns.cleanup_leftovers()
    print(f"removed {len(gone)} leftover namespace(s)" + (f": {' '.join(gone)}" if gone else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
