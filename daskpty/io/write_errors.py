"""The one-line error of a store write that cannot succeed by retrying (disk full, read-only,
no permission): :class:`StoreWriteError` and :func:`write_error`. Plain ``errno``, the bottom of
io's store handling (:mod:`~daskpty.io.lock` and :mod:`~daskpty.io.safety` both use it)."""
from __future__ import annotations

import errno

from ..faults import StoreWriteError  # noqa: F401 (also named here)

#: errno values of a write that cannot succeed by retrying: reported in one line (exit 2)
WRITE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS,
                                     errno.EACCES, errno.EPERM, errno.EFBIG) if e is not None)


def write_error(exc: OSError, what: str, path, intact: str) -> StoreWriteError | None:
    """A one-line :class:`StoreWriteError` for an OSError of :data:`WRITE_ERRNOS`, else None."""
    if isinstance(exc, StoreWriteError) or getattr(exc, "errno", None) not in WRITE_ERRNOS:
        return None
    where = getattr(exc, "filename", None)
    where = f" ({where})" if where else ""
    return StoreWriteError(exc.errno, f"{what} {path} failed: {exc.strerror or exc}{where}; "
                                      f"{intact}")
