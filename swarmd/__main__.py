"""``python -m swarmd``: the command line."""

from swarmd.cli import main

raise SystemExit(main())
