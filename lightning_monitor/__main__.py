"""``python -m lightning_monitor report LOGDIR``: the same command line as ``lightning-monitor``."""

import sys

from lightning_monitor.cli import main

if __name__ == "__main__":
    sys.exit(main())
