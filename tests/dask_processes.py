"""Helpers for tests that start dask's own command-line processes (a scheduler, workers)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dask_process(*args) -> subprocess.Popen:
    """``dask ARGS`` (this interpreter's ``dask`` command) in a session of its own, quiet."""
    dask = shutil.which("dask", path=os.path.dirname(sys.executable)) or "dask"
    return subprocess.Popen([dask, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
