"""``swarmd train`` that also ends once a stop file exists (tools/chaos.py fills its fault
window with training: the trainers get more steps than they can do and are told to end when
the window ends).

    python tools/chaoslab/train_until.py STOP_FILE <swarmd train arguments>

The file is looked at after every step (``swarmd.trainer.run.train``'s ``until``): the
trainer then ends as after its last step (its state saved, the final validation, the JSON
result), with the steps it did.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    stop = Path(argv[0])
    from swarmd import cli
    from swarmd.trainer import run

    train = run.train

    @functools.wraps(train)
    async def until_stopped(*args: Any, **kw: Any) -> Any:
        return await train(*args, **kw, until=stop.exists)

    run.train = until_stopped  # what `swarmd train` calls (imported when the command runs)
    return cli.main(["train", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
