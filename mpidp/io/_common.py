"""Plumbing shared by the readers and writers: the collective check, temporary names and the
commit by rename, netCDF-style dimensions that xarray recognises."""

from __future__ import annotations

import errno
import glob
import os
import re
import secrets
import shutil
import socket
import time
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from mpidp.comm import Transport
from mpidp.errors import DataError
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized

#: The attribute netCDF-4 puts on a dimension that has no coordinate variable.
PURE_DIM = "This is a netCDF dimension but not a netCDF variable."


def manager_or_default(manager: DistributedManager | None) -> DistributedManager | None:
    """``manager``, else mpidp's when it is initialised, else None (one process)."""
    if manager is not None:
        return manager
    return get_manager() if is_initialized() else None


def io_transport(manager: DistributedManager | None, group: Any) -> Transport | None:
    """The CPU transport of ``group`` (a name, a process group or a Transport); None when
    mpidp is not initialised and no manager is given (a single process)."""
    if isinstance(group, Transport):
        return group
    m = manager_or_default(manager)
    return None if m is None else m.transport(group, "cpu")


def check_everywhere(
    t: Transport | None,
    problems: Sequence[str],
    facts: Mapping[str, Any],
    what: str,
    fix: str,
    values: Sequence[int] = (),
) -> list[list[int]]:
    """Every rank's ``values``; or the same :class:`~mpidp.DataError` on every rank when any
    rank found a problem or the ranks' ``facts`` differ. Collective over ``t``."""
    if t is None:
        table, lines = [list(values)], [f"rank 0: {p}" for p in problems]
    else:
        table, lines = t.agree(problems, facts, values)
    if lines:
        rank = 0 if t is None else t.rank
        raise DataError(f"rank {rank}: {what}:\n  " + "\n  ".join(lines) + f"\nfix: {fix}")
    return table


class WriterTag(NamedTuple):
    """Who writes a temporary file: a random ``token`` (one per write), and the ``pid`` and a
    hash of the ``host`` name of the process that creates the file (world rank 0 for
    collective writes). Put in the name, it lets a later write remove a file whose writer is
    provably dead (:func:`remove_dead_temporaries`)."""

    token: int
    pid: int
    host: int

    @classmethod
    def here(cls, token: int) -> WriterTag:
        return cls(token, os.getpid(), host_hash())


def host_hash() -> int:
    """A 32-bit hash of this machine's host name (compared, never shown)."""
    return zlib.crc32(socket.gethostname().encode())


def shared_token(t: Transport | None) -> WriterTag:
    """A random number drawn by rank 0, with rank 0's pid and host, known to every rank (names
    temporary files). Collective: one all-gather of three ints."""
    mine = WriterTag.here(secrets.randbits(48))
    return mine if t is None else WriterTag(*t.all_gather_ints(list(mine))[0])


def temporary_name(path: Path, tag: WriterTag | int) -> Path:
    """A hidden name beside ``path`` (same file system, so the rename is atomic), tagged with
    its writer. Temporary files of ``path`` whose writer is dead are removed first (a job
    killed while writing leaves one); other old ones are reported, once per process and
    path. A bare ``int`` is a token of this process."""
    tag = tag if isinstance(tag, WriterTag) else WriterTag.here(tag)
    remove_dead_temporaries(path)
    _report_stale(path)
    return path.with_name(f".{path.name}.tmp-{tag.token:x}-p{tag.pid}-h{tag.host:08x}")


#: When this process started using mpidp.io: a temporary file untouched since before then (and
#: for over an hour) belongs to no write of this job.
_JOB_START = time.time()

_TAGGED = re.compile(r"\.tmp-[0-9a-f]+-p(\d+)-h([0-9a-f]{8})$")


def _writer_is_dead(pid: int, host: int, mtime: float) -> bool:
    if host == host_hash():
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, owned by another user
            return False
        return False
    # another machine's process cannot be asked: only a file untouched since before this job
    # began, and for an hour, is taken for dead (a live rollout writes a step more often)
    return mtime < min(_JOB_START, time.time() - 3600)


def remove_dead_temporaries(path: Path) -> list[str]:
    """Remove the temporary files of ``path`` that mpidp named (``.<name>.tmp-<token>-p<pid>-
    h<host>``) and whose writer is dead: on this host, a pid that no longer runs; on another,
    a file untouched since before this job started and for over an hour. Returns their names.
    Files of other names are never touched. Local."""
    removed: list[str] = []
    if not path.parent.is_dir():
        return removed
    for old in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        found = _TAGGED.search(old.name)
        if found is None:
            continue
        try:
            mtime = old.stat().st_mtime
            if _writer_is_dead(int(found.group(1)), int(found.group(2), 16), mtime):
                discard(old)
                removed.append(old.name)
        except FileNotFoundError:  # another rank removed it first
            continue
        except OSError:
            continue
    return removed


_REPORTED: set[str] = set()


def _report_stale(path: Path) -> None:
    """Warn about ``.<name>.tmp-*`` files beside ``path`` older than an hour that
    :func:`remove_dead_temporaries` kept (a writer that may be alive, or a name mpidp did not
    give). They are not removed: another job may be writing the same path right now."""
    key = os.path.realpath(path)
    if key in _REPORTED or not path.parent.is_dir():
        return
    _REPORTED.add(key)
    now = time.time()
    stale = []
    for old in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        try:
            st = old.stat()
        except OSError:
            continue
        if now - st.st_mtime > 3600:
            stale.append(f"{old.name} ({st.st_size} bytes)")
    if stale:
        warnings.warn(
            f"{path}: temporary files of an earlier write that did not finish (a killed job?) "
            f"lie beside it: {', '.join(stale)}; {path} itself is intact. Delete them when no "
            f"job is writing {path.name}",
            stacklevel=3,
        )


def explain_os_error(err: BaseException, path: Path) -> str:
    """``err`` described, with the free space of ``path``'s file system when that is what
    failed (a full disk shows up in torch.save as 'unexpected pos ...')."""
    text = f"{type(err).__name__}: {err}"
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return text
    full = isinstance(err, OSError) and err.errno == errno.ENOSPC
    if full or free < (64 << 20):
        text += f" (the file system of {path.parent} has {free} bytes free: is the disk full?)"
    return text


#: What HDF5 may add to a write beyond the data itself (chunk indices, the superblock, the
#: metadata cache flushed at close): the space kept free before a write starts.
HDF5_MARGIN = 1 << 20


def ensure_space(path: Path, need: int) -> None:
    """Raise ``OSError(ENOSPC)`` before writing ``need`` bytes into ``path`` when its file
    system has less than that plus :data:`HDF5_MARGIN` free: HDF5 that runs out of space
    mid-write fails at close and then crashes the process (a segmentation fault in h5py, seen
    with a RolloutWriter filling a 2 MB tmpfs), so the disk is checked first. Another process
    filling the disk between the check and the write is not covered."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return
    if free < need + HDF5_MARGIN:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: writing {need} bytes into {path} needs {need + HDF5_MARGIN} "
            f"free (with {HDF5_MARGIN} for HDF5's metadata), the file system has {free}",
        )


def agree_or_discard(
    t: Transport | None, tmp: Path, path: Path, error: BaseException | None, what: str
) -> None:
    """Every rank learns whether any rank's ``error`` happened; if one did, ``tmp`` is removed
    and every rank raises the same DataError (``path`` untouched). Collective: returns on
    every rank only after every rank got here."""
    problem = [] if error is None else [explain_os_error(error, path)]
    try:
        check_everywhere(
            t,
            problem,
            {},
            f"{what} failed; {path} was left as it was",
            "see the rank's error: on a full disk, free space or write elsewhere, then retry",
        )
    except DataError:
        discard(tmp)  # every rank: one of them may be alone to get here
        raise


def discard(tmp: Path) -> None:
    """Remove the temporary file or store (a folder) ``tmp``; nothing if it is gone."""
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def install(tmp: Path, path: Path) -> None:
    """Put ``tmp`` at ``path`` by a rename. A store (a folder) already at ``path`` cannot be
    renamed over: it is renamed aside first (``.<name>.old-<pid>``) and removed after, so a
    crash between the two renames (microseconds) leaves the previous store under that name,
    never half of one."""
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def commit(
    t: Transport | None, tmp: Path, path: Path, error: BaseException | None, what: str
) -> None:
    """Agree whether every rank succeeded; then rank 0 renames ``tmp`` to ``path`` (or removes
    it: the previous ``path`` stays untouched) and every rank returns or raises. Collective."""
    agree_or_discard(t, tmp, path, error, what)
    if t is None or t.rank == 0:
        install(tmp, path)
    if t is not None:
        t.barrier()  # the file is in place on return, on every rank


def digest(values: Any) -> int | None:
    """A checksum of an array's bytes (None for None): compared across ranks as a fact."""
    if values is None:
        return None
    return zlib.crc32(np.ascontiguousarray(values).tobytes())


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def declare_dims(
    f: h5py.File,
    dims: Sequence[str],
    shape: Sequence[int],
    coords: Mapping[str, Any],
    unlimited: Sequence[str] = (),
) -> list[h5py.Dataset]:
    """The dimension-scale datasets for ``dims`` (created when missing): coordinate values
    where ``coords`` has them, otherwise a netCDF pure dimension. Existing ones must match the
    length. Returns them in ``dims`` order (attach them with :func:`attach_dims`)."""
    scales = []
    for d, n in zip(dims, shape, strict=True):
        if d in f:
            ds = f[d]
            if ds.shape[0] != n and d not in unlimited:
                raise DataError(
                    f"dimension {d!r} already has {ds.shape[0]} entries in {f.filename}, "
                    f"the new variable has {n}; use another dimension name or a new file"
                )
            scales.append(ds)
            continue
        maxshape = (None,) if d in unlimited else (n,)
        chunks = (max(1, min(n, 1024)),) if d in unlimited else None
        if d in coords:
            values = np.asarray(coords[d])
            ds = f.create_dataset(d, data=values, maxshape=maxshape, chunks=chunks)
            ds.make_scale(d)
        else:
            ds = f.create_dataset(d, shape=(n,), dtype="f4", maxshape=maxshape, chunks=chunks)
            ds.make_scale(f"{PURE_DIM}{n:10d}")
        scales.append(ds)
    return scales


def attach_dims(ds: h5py.Dataset, scales: Sequence[h5py.Dataset]) -> None:
    for i, scale in enumerate(scales):
        ds.dims[i].attach_scale(scale)


def default_dims(ndim: int) -> tuple[str, ...]:
    """Dimension names when the caller gives none: (..., latitude, longitude)."""
    named = ("time", "channel", "latitude", "longitude")
    if ndim <= 4:
        return named[4 - ndim :]
    return tuple(f"dim{i}" for i in range(ndim - 4)) + named


def error(rank: int, what: str, fix: str) -> DataError:
    """The :class:`~mpidp.DataError` of a reader: one rank prefix, in front, and the fix."""
    what = re.sub(r"(^|: )rank \d+: ", r"\1", what)
    return DataError(f"rank {rank}: {what}; fix: {fix}")
