"""Never delete what daskpty did not write; check an output before computing into it.

A path counts as daskpty's own when it is

* a *store*: a directory whose ``zarr.json`` carries the ``daskpty`` format marker of a data set
  or a reconstruction, or
* a *leftover* of one of daskpty's atomic writes beside a store ``X``: ``X.partial-<hex>``
  (holding the ``.daskpty-writing`` marker file, a daskpty ``zarr.json``, or only the empty
  ``zarr.json`` of a just-created group), ``X.old-<hex>`` or ``X.previous`` holding a store.

:func:`remove_own` deletes only such paths (and empty directories). Everything here is plain
``os`` / ``json``: no zarr or dask import, so the command line can use it before anything starts.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import tempfile

from .lock import check_unlocked
from .write_errors import WRITE_ERRNOS, StoreWriteError, write_error  # noqa: F401  (re-exported)

#: ``daskpty.format`` values of the stores daskpty writes (see io/validate.py, results.py)
STORE_FORMATS = {"daskpty-dataset": "data set", "daskpty-reconstruction": "reconstruction"}
#: the format version this daskpty writes (and reads up to), per store format
FORMAT_VERSIONS = {"daskpty-dataset": 1, "daskpty-reconstruction": 1}
#: file inside a store being written (the data-set writer's and the reconstruction writer's)
WRITING_MARKER = ".daskpty-writing"
_LEFTOVER = re.compile(r"\.(partial|old)-[0-9a-f]{8}$")


# --------------------------------------------------------------------------- what is ours

def _root_attrs(path) -> dict | None:
    try:
        with open(os.path.join(os.fspath(path), "zarr.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def store_format(path) -> str | None:
    """``"daskpty-dataset"`` / ``"daskpty-reconstruction"`` for a daskpty store, else None."""
    meta = _root_attrs(path)
    marker = ((meta or {}).get("attributes") or {}).get("daskpty")
    fmt = marker.get("format") if isinstance(marker, dict) else None
    return fmt if fmt in STORE_FORMATS else None


def is_daskpty_store(path) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and store_format(path) is not None


def stored_epoch(path) -> int | None:
    """The epoch a reconstruction store at ``path`` holds (None when there is none)."""
    if store_format(path) != "daskpty-reconstruction":
        return None
    epoch = ((_root_attrs(path) or {}).get("attributes") or {}).get("epoch")
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None


def is_own_leftover(path) -> bool:
    """A ``X.partial-*`` / ``X.old-*`` directory left by one of daskpty's atomic writes."""
    path = os.fspath(path)
    if not _LEFTOVER.search(path) or not os.path.isdir(path) or os.path.islink(path):
        return False
    if os.path.exists(os.path.join(path, WRITING_MARKER)) or store_format(path) is not None:
        return True
    names = os.listdir(path)
    meta = _root_attrs(path)
    return names == ["zarr.json"] and meta is not None and meta.get("node_type") == "group" \
        and not meta.get("attributes")


def _empty_dir(path) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def deletion_order(path) -> list[str]:
    """The entries of the directory ``path`` in the order :func:`remove_tree` deletes them:
    everything else first, then the root ``zarr.json`` (what marks the tree as daskpty's), then
    the writing marker. A deletion killed at any step leaves a directory still marked as
    daskpty's (or an empty one), which the next write recognises and removes instead of refusing
    to replace a directory it cannot tell from a user's."""
    last = [os.path.join(path, name) for name in ("zarr.json", WRITING_MARKER)]
    entries = sorted(os.path.join(path, name) for name in os.listdir(path))
    return [e for e in entries if e not in last] + [e for e in last if os.path.lexists(e)]


def remove_tree(path) -> None:
    """Delete the directory tree ``path`` (daskpty's own) in :func:`deletion_order`."""
    if not os.path.isdir(path) or os.path.islink(path):
        return
    for entry in deletion_order(path):
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(entry)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    shutil.rmtree(path, ignore_errors=True)   # anything written meanwhile


def remove_own(path) -> None:
    """Delete ``path`` if daskpty wrote it (a store or a leftover) or it is an empty directory;
    refuse anything else with :class:`FileExistsError`. A missing path is fine."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    if _empty_dir(path):
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return
    if not (is_daskpty_store(path) or is_own_leftover(path)):
        raise FileExistsError(f"{path} is not a store daskpty wrote (no daskpty marker in its "
                              f"zarr.json); refusing to delete it: remove it yourself or choose "
                              f"another path")
    remove_tree(path)


def written_version(fmt: str) -> int:
    """The format version this daskpty writes for stores of format ``fmt``."""
    return FORMAT_VERSIONS[fmt]


def newer_format(path) -> int | None:
    """The format version of the daskpty store at ``path`` when it is newer than this daskpty
    writes (replacing it would lose what a newer daskpty stored), else None."""
    fmt = store_format(path)
    if fmt is None:
        return None
    version = ((_root_attrs(path) or {}).get("attributes") or {}).get("daskpty", {}).get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > written_version(fmt):
        return version
    return None


def check_not_link(path, what: str = "the output") -> None:
    """Refuse a symbolic link as a path to replace: replacing it would swap the link for a new
    store and leave the store it points to (perhaps another run's) as it was, and deleting through
    it would reach outside the named path. The line names the target and what to pass instead."""
    path = os.fspath(path)
    if os.path.islink(path):
        target = os.readlink(path)
        real = os.path.realpath(path)
        raise FileExistsError(f"{path} ({what}) is a symbolic link to {target}; daskpty does not "
                              f"replace links: pass the target {real} itself, or remove the link "
                              f"({path}) and write there")


def check_replaceable(path, what: str = "the output") -> None:
    """Refuse to replace ``path`` unless it is absent, an empty directory or a daskpty store of a
    format version this daskpty writes (or an older one); a symbolic link is refused as one
    (:func:`check_not_link`)."""
    path = os.fspath(path)
    check_not_link(path, what)
    if os.path.lexists(path) and not (_empty_dir(path) or is_daskpty_store(path)):
        kind = "a file" if not os.path.isdir(path) else "a directory that is not a daskpty store"
        raise FileExistsError(f"{path} ({what}) is {kind}; daskpty replaces only stores it wrote: "
                              f"remove it yourself or choose another path")
    newer = newer_format(path) if os.path.isdir(path) else None
    if newer is not None:
        fmt = store_format(path)
        raise FileExistsError(f"{path} ({what}) is a daskpty {STORE_FORMATS[fmt]} in format version "
                              f"{newer}, newer than this daskpty writes ({written_version(fmt)}); "
                              f"refusing to replace it with an older format: upgrade daskpty, or "
                              f"choose another path")


def interrupted_copy(path) -> str | None:
    """``X.previous`` or ``X.old-*`` holding a daskpty store while ``X`` itself is missing: the
    only copy left by a write interrupted between its two renames."""
    path = os.fspath(path).rstrip("/")
    if os.path.lexists(path):
        return None
    candidates = [path + ".previous"] + sorted(glob.glob(glob.escape(path) + ".old-*"))
    return next((c for c in candidates if is_daskpty_store(c)), None)


def stale_leftovers(path) -> list[str]:
    """daskpty's own ``X.partial-*`` (and, while ``X`` is a complete store, ``X.old-*``) beside
    ``X``: leftovers of killed writes. Call with ``X``'s lock held (then nobody writes them)."""
    path = os.fspath(path).rstrip("/")
    found = [p for p in glob.glob(glob.escape(path) + ".partial-*") if is_own_leftover(p)]
    if is_daskpty_store(path):
        found += [p for p in glob.glob(glob.escape(path) + ".old-*") if is_own_leftover(p)]
    return sorted(found)


def clean_stale(path) -> list[str]:
    """Remove :func:`stale_leftovers` of ``path``; returns what was removed."""
    removed = []
    for p in stale_leftovers(path):
        remove_tree(p)
        if not os.path.lexists(p):
            removed.append(p)
    return removed


# --------------------------------------------------------------------------- where outputs go

def _real(path) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _inside(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_separate(output, data_path, what: str = "the checkpoint") -> None:
    """Refuse an output equal to, inside, or containing the data store."""
    if output is None or data_path is None:
        return
    out, data = _real(output), _real(data_path)
    if out == data:
        raise ValueError(f"{what} {output} is the data store; writing it would replace the data: "
                         f"choose another output path")
    if _inside(out, data):
        raise ValueError(f"{what} {output} lies inside the data store {data_path}; choose a path "
                         f"outside it")
    if _inside(data, out):
        raise ValueError(f"the data store {data_path} lies inside {what} {output}; replacing "
                         f"{output} would delete it: choose another output path")


def _existing_parent(path) -> str:
    parent = os.path.dirname(os.path.abspath(os.fspath(path)).rstrip(os.sep)) or os.sep
    while not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise NotADirectoryError(f"cannot write {path}: {parent} is not a directory")
        parent = os.path.dirname(parent)
    return parent


def check_writable(path) -> None:
    """Try to create (and remove) a file where ``path``'s temporary store will go."""
    parent = _existing_parent(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".daskpty-probe-", dir=parent)
    except OSError as exc:
        raise StoreWriteError(exc.errno, f"cannot write {path}: {exc.strerror} in {parent}; "
                                         f"choose another output or fix the permissions") from None
    os.close(fd)
    os.remove(probe)


def free_bytes(path) -> int:
    return shutil.disk_usage(_existing_parent(path)).free


def store_bytes(path) -> int:
    """Bytes on disk under ``path`` (sum of file sizes; files that vanish meanwhile count 0)."""
    total = 0
    for dirpath, _, files in os.walk(os.fspath(path)):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


def reconstruction_bytes(object_shape, probe_shape, n_positions: int) -> int:
    """Upper estimate of a reconstruction store's size (uncompressed arrays: object, velocity,
    illumination, probe, positions, plus attributes)."""
    pixels = 1
    for s in object_shape:
        pixels *= int(s)
    probe = 1
    for s in probe_shape:
        probe *= int(s)
    return pixels * (8 + 8 + 4) + probe * 8 + int(n_positions) * 16 + 2**20


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_free_space(path, store_estimate: int) -> None:
    """Refuse when the disk of ``path`` cannot hold one more copy of the store beside the one
    being replaced (a checkpoint is written completely before the old one goes)."""
    existing = store_bytes(path) if os.path.isdir(path) else 0
    need = max(store_estimate, 2 * store_estimate - existing)
    free = free_bytes(path)
    if free < need:
        raise StoreWriteError(errno.ENOSPC, f"not enough free space for {path}: about "
                                            f"{_mib(need)} needed (the result and one "
                                            f"checkpoint), {_mib(free)} free; free some "
                                            f"space or choose another output")


def intact_note(path) -> str:
    """What is left at ``path`` after a failed write: the store and its epoch, or nothing."""
    path = os.fspath(path).rstrip("/")
    for where in (path, path + ".previous"):
        if is_daskpty_store(where):
            epoch = stored_epoch(where)
            what = f"epoch {epoch}" if epoch is not None else STORE_FORMATS[store_format(where)]
            return f"{where} still holds {what}, intact; no partial store was left"
    return "nothing was written there and no partial store was left"


def check_checkpoint_target(path, data_path=None) -> None:
    """Everything about a reconstruction's output that can be checked before computing: not the
    data store (nor inside it, nor around it), nothing but a daskpty reconstruction (or an empty
    directory) to replace, no data store being written, a writable place. Removes daskpty's own
    leftovers of killed writes there (call with the output's lock held)."""
    if data_path is not None:
        check_unlocked(data_path)
    if path is None:
        return
    check_separate(path, data_path)
    path = os.fspath(path).rstrip("/")
    for where in (path, path + ".previous"):
        check_replaceable(where, "the checkpoint")
        if store_format(where) == "daskpty-dataset":
            raise FileExistsError(f"{where} is a daskpty data set; a reconstruction never replaces "
                                  f"one: choose another output path")
    check_writable(path)
    clean_stale(path)


__all__ = ["STORE_FORMATS", "StoreWriteError", "WRITE_ERRNOS", "check_checkpoint_target",
           "check_free_space", "check_not_link", "check_replaceable", "check_separate", "check_writable", "clean_stale",
           "interrupted_copy", "intact_note", "is_daskpty_store", "is_own_leftover", "newer_format",
           "reconstruction_bytes", "remove_own", "stale_leftovers", "store_format",
           "stored_epoch", "write_error"]
