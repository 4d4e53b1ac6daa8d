"""Atomic root checkpoints: temp file, fsync, rename; the last K kept (sync, no event loop).

>>> import tempfile
>>> directory = tempfile.mkdtemp()
>>> load_latest(directory) is None                # None when there is none
True
>>> for version in (10, 20, 30):
...     path = save(directory, version, {"values": np.ones(3, np.float32)}, {"job": "lm"}, keep=2)
>>> path.name, [p.name for p in list_checkpoints(directory)]   # the last ``keep`` kept
('ckpt-000000000030.npz', ['ckpt-000000000020.npz', 'ckpt-000000000030.npz'])
>>> arrays, meta = load_latest(directory)         # numpy arrays, and the JSON-able meta
>>> arrays["values"], meta
(array([1., 1., 1.], dtype=float32), {'job': 'lm'})

The root takes an in-memory copy and calls ``save`` in a thread, so training does not stall
on the disk. A crash mid-write leaves only a ``.tmp`` file, which loading ignores
(and a root deletes at start: ``sweep_temporary``).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import threading
import zipfile
from pathlib import Path
from typing import IO

import numpy as np

__all__ = ["save", "save_bytes", "to_bytes", "load_latest", "list_checkpoints", "write_atomic", "fsync_dir", "hold",
           "sweep_temporary"]

LOCK_FILE = ".lock"


def hold(directory: str | Path, holder: str = "root", advice: str = "give this one a --checkpoint-dir of its own"
         ) -> IO[str]:
    """An exclusive lock on a root's checkpoint directory, held while the returned file is open
    (the process's life at most: the kernel drops it at exit, kill -9 included). A second root on
    the same directory -- left running by a launcher that crashed, a second pod on one volume --
    would append to the same logs and overwrite the same checkpoints: it is refused at start,
    with the holder's pid, as OSError(EBUSY). (``hps launch`` and ``hps demo`` hold their log
    directory the same way: ``holder`` and ``advice`` word the refusal.)"""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    f = open(d / LOCK_FILE, "a+")  # held open for the root's life
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read(32).strip() or "unknown"
        f.close()
        raise OSError(errno.EBUSY, f"{d} is in use by another {holder} (pid {pid}); stop that one first, or "
                      f"{advice}") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def sweep_temporary(directory: str | Path) -> int:
    """Delete the temporary files writes that never finished left (a crash mid-write) in a
    checkpoint directory and its job directories; how many. Call it only while holding the
    directory (``hold``) and before this process writes: each writer's temporary name is its
    own (``write_atomic``), so without this every crash during a checkpoint left one behind."""
    gone = 0
    d = Path(directory)
    for p in [*d.glob(".*.tmp"), *d.glob("*/.*.tmp")]:
        try:
            p.unlink()
            gone += 1
        except FileNotFoundError:
            pass
    return gone


def list_checkpoints(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("ckpt-*.npz"))


def version_of(path: Path) -> int:
    """The version a checkpoint file holds, from its name (``ckpt-000000000030.npz``: 30)."""
    return int(path.stem.split("-", 1)[1])


def to_bytes(arrays: dict[str, np.ndarray], meta: dict) -> bytes:
    """A checkpoint file's bytes (what a primary sends its standby to start from)."""
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def save(directory: str | Path, version: int, arrays: dict[str, np.ndarray], meta: dict,
         keep: int = 3) -> Path:
    return save_bytes(directory, version, to_bytes(arrays, meta), keep)


def write_atomic(path: Path, data: bytes | str, tmp: Path | None = None) -> None:
    """Replace ``path`` with ``data`` durably: a temporary file, fsync, rename, fsync of the
    directory (a crash leaves the old file or the new one, never a part). The temporary name is
    this writer's own (process, thread): two writers of one path never publish each other's
    half-written file."""
    base = (tmp.name if tmp is not None else f".{path.name}").removesuffix(".tmp")
    tmp = path.with_name(f"{base}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)  # make the rename itself durable


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (a file renamed or created in it) durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_bytes(directory: str | Path, version: int, data: bytes, keep: int = 3) -> Path:
    """``save`` of a checkpoint file's bytes (``to_bytes``), atomically. Each also makes the
    directory's own entry durable (a power cut could otherwise lose the whole job directory,
    checkpoint and log, after its creation was acknowledged): every time, not only for a
    directory's first checkpoint, which a failed save may have left behind un-fsynced."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{version:012d}.npz"
    write_atomic(final, data, tmp=d / f".ckpt-{version:012d}.npz.tmp")
    fsync_dir(d.parent)
    for old in list_checkpoints(d)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_latest(directory: str | Path) -> tuple[dict[str, np.ndarray], dict] | None:
    for path in reversed(list_checkpoints(directory)):
        try:
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files if k != "__meta__"}
                meta = json.loads(bytes(z["__meta__"]).decode())
            return arrays, meta
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            continue  # a damaged file (truncated, bit-flipped, empty): fall back to the one before
    return None
