"""A push sent while its gradient is still being computed (the worker's backward overlap).

>>> import numpy as np
>>> from ps.core.config import JobConfig
>>> from ps.core.view import KeySpec, Layout
>>> layout = Layout([KeySpec("fc.weight", (2, 3)), KeySpec("fc.bias", (2,))])
>>> client = ParameterClient(address, job="streamed", worker_id="w0")
>>> client.create_job(JobConfig(name="streamed"), layout, np.zeros(8, np.float32))
True
>>> client.register(); _ = client.pull()
>>> grad = np.ones(8, np.float32)
>>> stream = StreamedPush.open(client, clock=0)   # the header goes out now
>>> stream.add(client.encoder.split(layout, grad, only=frozenset({"fc.bias"})))  # a bucket, when ready
8
>>> stream.add(client.encoder.split(layout, grad, only=frozenset({"fc.weight"})))
24
>>> stream.finish(StepInfo(), report=(0.7, 1, 0.2))   # tail, end marker; (applied version, bytes)
(1, 32)
>>> client.close()

The push's frames go up as they are made, on the RPC's own thread, so the transfer overlaps
whatever the caller does meanwhile (the rest of backward). Its step information and telemetry,
known only at the end, travel in the tail frame just before the end marker (``PushTail``).
Everything else is a push as ``ParameterClient.push`` sends it: one sequence number, the same
bytes on every retry (the frames are kept until the push is answered), applied once.

``abort()`` cuts the stream before its end marker: the tier changes nothing (a cut push is
never taken for a whole one), the sequence number is not used up, and the next push takes it.
Only bsp-style pushes (one in flight) are streamed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

from ps.core.errors import BadInput
from ps.core.tensors import payload_bytes
from ps.core.types import Chunk, PushMeta, StepInfo
from ps.net.frames import with_end
from ps.net.wire import chunk_frames, encode_push_head, encode_push_tail, push_digest
from worker.client import ParameterClient

__all__ = ["StreamedPush"]


class StreamedPush:
    """One push whose chunks are added while it is being sent (see the module)."""

    def __init__(self, client: ParameterClient, meta: PushMeta) -> None:
        self.client, self.meta = client, meta
        self.payload = 0
        self._frames = [encode_push_head(meta)]
        self._state = "open"  # -> "done" (end marker added) or "aborted"
        self._cv = threading.Condition()
        self._reply: tuple[int, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"hps-stream-{client.worker_id}")
        self._thread.start()

    @classmethod
    def open(cls, client: ParameterClient, clock: int) -> StreamedPush:
        """Open a push of this worker's gradient at ``clock``, computed on the view it holds."""
        client._land_pending()  # a push interrupted on its way: its outcome first
        if client._go_home.is_set():
            client._move_home()
        if client._unsure is not None and client._unsure[0] == client.acked_seq + 1:
            client._settle_unsure()  # a new gradient: it may not take the number of one applied
        with client._push_lock:
            seq = client.seq = client.acked_seq + 1
        view = client.view
        return cls(client, PushMeta(client.job, client.worker_id, seq, view.version, view.epoch, contributors=1,
                                    clock_min=clock, clock_max=clock, clock_floor=clock + 1,
                                    incarnation=client.incarnation))

    @property
    def aborted(self) -> bool:
        return self._state == "aborted"

    @property
    def sent_whole(self) -> bool:
        """Its end marker was added: the RPC's thread delivers it whole, whatever the caller does."""
        return self._state == "done"

    @property
    def delivering(self) -> bool:
        """Sent whole and not answered yet (its RPC thread still runs)."""
        return self.sent_whole and self._thread.is_alive()

    def outcome(self) -> tuple[tuple[int, int] | None, BaseException | None]:
        """Wait for the RPC's thread (bounded: the delivery's retry window, the frames' round
        timeout), then (its reply, its error): one of them is set."""
        self._wait()
        return self._reply, self._error

    def add(self, chunks: list[Chunk]) -> int:
        """Send ``chunks`` next (encoded by the client's encoder); returns their payload bytes."""
        frames, n = list(chunk_frames(chunks)), payload_bytes(chunks)
        with self._cv:
            if self._state != "open":
                raise RuntimeError(f"push {self.meta.seq} is {self._state}: no chunk can be added")
            self._frames.extend(frames)
            self.payload += n
            self._cv.notify_all()
        return n

    def finish(self, step: StepInfo, report: tuple[float, int, float] = (0.0, 0, 0.0)) -> tuple[int, int]:
        """Close the push with its step information and telemetry, and wait for its answer:
        (the version that applied it, payload bytes); raises what ``ParameterClient.push`` would."""
        loss, count, secs = report
        try:
            tail = encode_push_tail(replace(self.meta, loss_sum=loss, loss_count=count, step_seconds_sum=secs,
                                            step=step))
            # Digested outside the lock (the sending thread goes on meanwhile): once the caller
            # finishes, nothing is added any more.
            whole = with_end([*self._frames, tail])
        except BaseException:
            self.abort()
            raise
        with self._cv:
            if self._state != "open":
                raise RuntimeError(f"push {self.meta.seq} is {self._state}")
            self._frames = whole
            self._state = "done"
            self._cv.notify_all()
        self._wait()  # (interrupted, with Ctrl-C: the push goes on being delivered; see ``Sent``)
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply

    def abort(self) -> None:
        """Cut the stream before its end marker: nothing of it is applied anywhere. Returns at
        once; the RPC's thread ends on its own (a retry in progress sends a cut stream too)."""
        with self._cv:
            if self._state == "open":
                self._state = "aborted"
                self._cv.notify_all()

    def _wait(self) -> None:
        self._thread.join()

    # -- the RPC's side ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._reply = self.client._deliver(self.meta.seq, self._iter, self._digest, self.meta.contributors,
                                               lambda: self.payload)
        except BaseException as exc:  # handed to finish(); an aborted push's error is nobody's
            self._error = exc

    def _iter(self) -> Iterator[bytes]:
        """The frames from the first, waiting for the next until the end marker; stops short
        (a cut stream) once aborted, or when nothing came for the round timeout."""
        i = 0

        def more() -> bool:
            return i < len(self._frames) or self._state != "open"
        while True:
            with self._cv:
                if not self._cv.wait_for(more, timeout=self.client.round_timeout_s):
                    return
                if self._state == "aborted" or i >= len(self._frames):
                    return
                frame = self._frames[i]
            i += 1
            yield frame

    def _digest(self) -> bytes:
        """The end marker's digest (the push's identity), once the push is complete."""
        with self._cv:
            self._cv.wait_for(lambda: self._state != "open", timeout=self.client.round_timeout_s)
            if self._state != "done":
                raise BadInput(f"push {self.meta.seq} was aborted or never completed; it has no digest")
            return push_digest(self._frames)
