"""Remove the namespaces of labs whose process died: ``python -m tools.wanlab.cleanup``."""

from __future__ import annotations

import sys

from tools.wanlab.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["--cleanup"]))
