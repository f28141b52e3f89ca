"""``python -m daskpty``: the daskpty command line.

``kill -USR1 <pid>`` makes a running command print every thread's stack to stderr (and go on):
the first thing to look at when a run seems stuck."""
import faulthandler
import signal
import sys

from daskpty.cli import main

if __name__ == "__main__":
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.exit(main())
