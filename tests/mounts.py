"""Small real filesystems for the disk-full and read-only tests: a tmpfs of a given size,
optionally remounted read-only. Needs root and a kernel that lets this process mount (a
container without CAP_SYS_ADMIN does not); :func:`tmpfs` says why when it cannot."""
from __future__ import annotations

import contextlib
import os
import subprocess


def _run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


def mount_tmpfs(path, size: str = "3m", read_only: bool = False) -> str | None:
    """Mount a tmpfs of ``size`` at ``path`` (created); None on success, else the reason."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    r = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    if r.returncode != 0:
        return f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
    if read_only:
        r = _run("mount", "-o", "remount,ro", str(path))
        if r.returncode != 0:
            umount(path)
            return f"remount,ro failed: {r.stderr.strip() or r.returncode}"
    return None


def umount(path) -> None:
    _run("umount", "-l", str(path))


@contextlib.contextmanager
def tmpfs(path, size: str = "3m", read_only: bool = False):
    """Context manager: yields None with the tmpfs mounted at ``path``, or the reason it is not."""
    reason = mount_tmpfs(path, size, read_only)
    try:
        yield reason
    finally:
        if reason is None:
            umount(path)
