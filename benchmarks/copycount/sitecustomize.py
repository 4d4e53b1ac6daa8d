"""Which source line copied: imported at start-up by every Python process of a ``copies.py
--sites`` row (this directory is put first on PYTHONPATH), in processes that run under
``copycount.c``. A line tracer on every thread reads the thread's own counters (``ctypes``) at
each line, call and return, and credits what was copied or allocated since to the line that
ran last, so copies inside C (numpy, gRPC's Cython) land on the Python line that called them.
Slow: for finding copies, never for timings.

SIGUSR1 clears the tally (the benchmark sends it before its counted rounds), SIGUSR2 writes it
to ``$HPS_COPYCOUNT_DIR/<pid>.sites.json`` as {line: [memcpy bytes, allocated bytes]}. An
asyncio tier's main thread runs a signal's handler at its next wake-up (within its heartbeat).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading

if os.environ.get("HPS_COPYCOUNT_SITES") and os.environ.get("HPS_COPYCOUNT_DIR"):
    _own = ctypes.CDLL(None).copycount_thread
    _own.restype = ctypes.POINTER(ctypes.c_uint64)
    _local = threading.local()
    _tally: dict[str, list[int]] = {}
    _MIN = 1 << 16  # smaller amounts between two events are Python's own bookkeeping

    def _credit(where: str | None) -> None:
        c = _local.c
        copied, allocated = c[0] - _local.copied, c[2] - _local.allocated
        if where is not None and (copied >= _MIN or allocated >= _MIN):
            t = _tally.setdefault(where, [0, 0])
            t[0] += copied
            t[1] += allocated
        _local.copied, _local.allocated = c[0], c[2]

    def _at(frame) -> str:
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"

    def _trace(frame, event, arg):
        if not hasattr(_local, "c"):
            _local.c = _own()
            _local.copied, _local.allocated, _local.where = _local.c[0], _local.c[2], None
        _credit(_local.where)
        if event == "return":
            back = frame.f_back
            _local.where = _at(back) if back is not None else None
        else:
            _local.where = _at(frame)
        return _trace

    def _clear(*_) -> None:
        _tally.clear()

    def _dump(*_) -> None:
        path = os.path.join(os.environ["HPS_COPYCOUNT_DIR"], f"{os.getpid()}.sites.json")
        with open(path + ".tmp", "w") as f:
            json.dump(_tally, f)
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR1, _clear)
    signal.signal(signal.SIGUSR2, _dump)
    threading.settrace(_trace)
    sys.settrace(_trace)
