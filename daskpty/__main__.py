"""``python -m daskpty``: the daskpty command line (the same as the ``daskpty`` command)."""
import sys

from daskpty.cli import main

if __name__ == "__main__":
    sys.exit(main())
