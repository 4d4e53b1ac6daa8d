"""Sending a bsp step's gradient while backward still runs (``HpsOptimizer(..., overlap=True)``).

>>> import numpy as np
>>> from ps.core.config import JobConfig
>>> from ps.core.types import StepInfo
>>> from ps.core.view import KeySpec, Layout
>>> model = torch.nn.Linear(3, 2)
>>> keys = [(n, p, "param") for n, p in model.named_parameters()]
>>> layout = Layout([KeySpec(n, tuple(p.shape)) for n, p, _ in keys])
>>> client = ParameterClient(address, job="overlap", worker_id="w0")
>>> client.create_job(JobConfig(name="overlap"), layout, np.zeros(layout.numel, np.float32))
True
>>> client.register(); _ = client.pull()
>>> overlap = Overlap(client, keys, layout, bucket_bytes=8, clock=lambda: 0)   # hooks on trained keys
>>> [[keys[i][0] for i in b] for b in overlap.buckets]         # in the order backward makes them
[['bias'], ['weight']]
>>> model(torch.ones(4, 3)).sum().backward()   # each bucket is encoded and sent when it is full
>>> sent = overlap.complete(sync_buffers=False)   # the rest (none here), and what the tail says
>>> sent.absent, sent.overflow
((), False)
>>> sent.stream.finish(StepInfo(absent=sent.absent, skip=sent.overflow))   # (applied version, bytes)
(1, 32)
>>> overlap.close(); client.close()

Parameters are grouped into buckets of about ``bucket_bytes`` in reverse layout order (the
order backward makes their gradients, as DDP's buckets are). A post-accumulate-grad hook copies
each gradient into one flat buffer on the training device; when a bucket's last gradient is in,
a background thread encodes it with the push edge's encoder (top-k and int8 run on the device;
error feedback per chunk, exactly as a whole push's) and adds its frames to a ``StreamedPush``,
whose RPC thread sends them while backward goes on. ``complete`` adds what no hook sent (a
parameter whose hook never ran, buffers on a step that averages them) and reports the keys
that carry nothing (``StepInfo.absent``), just as a whole push would.

A gradient that changes after its bucket went out (``clip_grad_norm_`` in the script, or a
second ``backward()`` before ``step()``) would be silently lost, so it is detected (by the
tensor's version counter) and refused: the push is cut, nothing of the step is applied, and the
error says what to do (clip at the root with ``OptimizerConfig.clip_grad_norm``, accumulate
micro-batches inside ``no_sync()``, or ``overlap=False``); an edit through ``.data`` bypasses
the version counter and is not seen. A key with a non-finite gradient is sent as zeros and the
step's tail asks for the round to be skipped, as a whole push's does. A push that is cut, or
whose round is skipped, leaves the encoder's error-feedback state as it was before the step
(``Encoder.begin``/``roll_back``), so nothing of that step is applied anywhere, later included.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ps.core.errors import BadInput, Conflict, Stale
from ps.core.types import StepInfo
from ps.core.view import Layout
from worker.client import ParameterClient
from worker.streamed import StreamedPush

__all__ = ["Overlap", "Sent"]

_STOP = -1


@dataclass(frozen=True)
class Sent:
    """A completed streamed push, before its tail: what the step's ``StepInfo`` must say."""

    stream: StreamedPush
    absent: tuple[int, ...]  # keys that carry nothing (no gradient, frozen, unsynced buffers)
    overflow: bool           # some gradient was not finite: the round must be skipped
    client: ParameterClient  # whose encoder records what the push did to its residuals

    def finish(self, step: StepInfo, report: tuple[float, int, float]) -> tuple[int, int]:
        """Send the tail and wait for the answer (``StreamedPush.finish``), then end the
        encoder's recording as ``ParameterClient.push`` does: kept if the push was applied, set
        aside if it was sent and went unanswered (the next push asks the root), taken back if not
        (its round skipped, for any worker's overflow, or the push refused, or it was cut), so
        the residual still owes what it carried.

        Interrupted (Ctrl-C) while the push is on its way, it is delivered all the same (its RPC
        thread goes on): what its encode did is decided once that ends, before the next push
        (``ParameterClient._land_pending``), not guessed now: its round may still be skipped."""
        try:
            result = self.stream.finish(step, report)
        except BaseException as exc:
            if self.stream.delivering:
                self.client._pending = self._landed
            elif self.stream.sent_whole:  # (it ended meanwhile: its own outcome, not the interrupt's)
                self._landed()
            else:
                self._end(exc)
            raise
        self._end(None)
        return result

    def _landed(self) -> None:
        """End the recording by what became of the push's delivery (waited for)."""
        reply, error = self.stream.outcome()
        if reply is not None:  # (the script heard nothing: a step sent again gets this version)
            self.client._heard(self.stream.meta.seq, reply[0], self.client.last_skipped)
        self._end(error)

    def _end(self, error: BaseException | None) -> None:
        encoder = self.client.encoder
        if not encoder.recording:
            return
        if error is None:  # answered: applied, or placed in a round that was skipped
            if self.overflow or self.client.last_skipped:
                encoder.roll_back()
            else:
                encoder.commit()
        elif isinstance(error, (Stale, BadInput, Conflict, RuntimeError)) or self.stream.aborted:
            encoder.roll_back()  # not applied, and it will not be (refused, or cut before its end)
        else:  # sent and unanswered (it may still be applied), or refused by another answer
            unsure = self.client._unsure
            if unsure is not None and unsure[0] == self.stream.meta.seq:
                encoder.set_aside()  # until the next push asks the root what became of it
            else:  # (an answer: refused credentials, an unknown job): not applied
                encoder.roll_back()

    def abort(self) -> None:
        """Cut the push (nothing of it applied) and take its encode back."""
        self.stream.abort()
        if self.client.encoder.recording:
            self.client.encoder.roll_back()


class Overlap:
    """Backward hooks that stream a bsp push bucket by bucket (see the module)."""

    def __init__(self, client: ParameterClient, keys: list[tuple[str, torch.Tensor, str]], layout: Layout,
                 bucket_bytes: int = 25 << 20, clock: Callable[[], int] = lambda: 0) -> None:
        self.client, self.keys, self.layout = client, keys, layout
        self.clock = clock  # the clock of the step whose gradients backward is making
        device = keys[0][1].device
        self.flat = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self._span = [(layout.offset(name), t.numel()) for name, t, _ in keys]
        # Buckets of consecutive trained keys, from the last (whose gradients come first).
        self.buckets: list[list[int]] = []
        size = bucket_bytes
        for i in reversed(range(len(keys))):
            if keys[i][2] != "param":
                continue
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += 4 * keys[i][1].numel()
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.paused = False  # no_sync(): hooks do nothing
        self._lock = threading.Lock()
        self._reset()
        self._queue: queue.Queue[int] = queue.Queue()
        self._thread = threading.Thread(target=self._encode_loop, daemon=True,
                                        name=f"hps-overlap-{client.worker_id}")
        self._thread.start()
        self._hooks = [t.register_post_accumulate_grad_hook(self._hook(i))
                       for i, (_, t, kind) in enumerate(keys) if kind == "param"]

    def _reset(self) -> None:
        with self._lock:
            self.stream: StreamedPush | None = None
            self._sent: dict[int, tuple[torch.Tensor, int]] = {}  # key -> (its grad, grad version)
            self._again: set[int] = set()  # keys whose hook ran again after they were taken
            self._copied: dict[int, torch.cuda.Event] = {}  # CUDA: each key's copy, done
            self._left = [len(b) for b in self.buckets]  # gradients each bucket still waits for
            self.overflow = False
            self._error: BaseException | None = None

    @property
    def active(self) -> bool:
        """A gradient of this step has been taken by a hook (the step's push is under way)."""
        return bool(self._sent)

    # -- backward's side --------------------------------------------------------------------
    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.paused or param.grad is None:
                return
            with self._lock:
                if i in self._sent:
                    self._again.add(i)
                    return
                g = param.grad
                self._sent[i] = (g, g._version)
                self._take(i, g)
                self._left[self._bucket_of[i]] -= 1
                ready = self._left[self._bucket_of[i]] == 0
            if ready:
                self._queue.put(self._bucket_of[i])
        return hook

    def _take(self, i: int, g: torch.Tensor) -> None:
        off, n = self._span[i]
        with torch.no_grad():
            self.flat[off:off + n].copy_((g.coalesce().to_dense() if g.is_sparse else g).reshape(-1))
        if self.flat.is_cuda:
            # The copy is queued on backward's stream; the encoding thread's work on the
            # bucket waits for it (it may run on another stream).
            self._copied[i] = torch.cuda.Event()
            self._copied[i].record(torch.cuda.current_stream(self.flat.device))

    # -- the encoding thread -----------------------------------------------------------------
    def _encode_loop(self) -> None:
        while True:
            b = self._queue.get()
            try:
                if b == _STOP:
                    return
                if self._error is None:
                    self._send([self.keys[i][0] for i in self.buckets[b]], self.buckets[b])
            except BaseException as exc:  # raised by complete(), on the training thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _send(self, names: list[str], members: list[int]) -> None:
        """Encode these keys' slots of the flat buffer and add them to the stream (opened by
        the first bucket): a non-finite key goes as zeros and marks the step's overflow."""
        if self.flat.is_cuda:
            stream = torch.cuda.current_stream(self.flat.device)
            for i in members:
                if i in self._copied:
                    stream.wait_event(self._copied.pop(i))
        with torch.no_grad():
            for i in members:
                off, n = self._span[i]
                part = self.flat[off:off + n]
                if not bool(torch.isfinite(part).all()):
                    part.zero_()
                    self.overflow = True
        if self.stream is None:
            self.client._land_pending()  # a push interrupted on its way: its recording ends first
            self.client.encoder.begin()  # a cut push puts the residuals back as they were
            self.stream = StreamedPush.open(self.client, self.clock())
        # copy=False: fp32 chunks are views of the flat buffer, framed by add() at once.
        chunks = self.client.encoder.split(self.layout, self.flat, step=self.clock(), only=frozenset(names),
                                           copy=False)
        self.stream.add(chunks)

    # -- step()'s side ---------------------------------------------------------------------
    def complete(self, sync_buffers: bool) -> Sent:
        """Wait for the buckets handed to the encoder, send what no hook did, and hand back the
        stream to finish. Raises ValueError (the push cut, nothing applied) when a gradient
        changed after it was sent, and what encoding or opening the push raised."""
        self._queue.join()
        try:
            if self._error is not None:
                raise self._error
            changed = sorted(self._again | {i for i, (g, v) in self._sent.items()
                                            if self.keys[i][1].grad is not g or g._version != v})
            if changed:
                names = ", ".join(self.keys[i][0] for i in changed[:3]) + (" ..." if len(changed) > 3 else "")
                raise ValueError(
                    f"with overlap=True each gradient is sent as backward() makes it, and {len(changed)} "
                    f"changed after that ({names}): gradient clipping in the script, a second backward() "
                    "before step(), or activation checkpointing with use_reentrant=True (a backward per "
                    "segment: a parameter shared by two segments gets its gradient twice). Clip at the root "
                    "(OptimizerConfig.clip_grad_norm), accumulate micro-batches inside opt.no_sync(), pass "
                    "use_reentrant=False to torch.utils.checkpoint, or pass overlap=False. Nothing of this "
                    "step was applied")
            rest, absent = [], []
            with torch.no_grad():
                for i, (_, t, kind) in enumerate(self.keys):
                    if i in self._sent:
                        if self._left[self._bucket_of[i]]:  # taken, but its bucket never filled up
                            rest.append(i)
                        continue
                    g = t.grad if kind == "param" else None
                    if g is not None:
                        self._take(i, g)
                    elif kind == "buffer" and sync_buffers:
                        off, n = self._span[i]
                        self.flat[off:off + n].copy_(t.detach().reshape(-1))
                    else:
                        absent.append(i)
                        continue
                    rest.append(i)
            if rest or self.stream is None:
                self._send([self.keys[i][0] for i in rest], rest)
            assert self.stream is not None
            # The encoder's recording stays open: the caller ends it once the push's answer is
            # in (``Sent.finish``), since a round skipped for another worker's overflow, or a
            # push refused, applies nothing of it either.
            return Sent(self.stream, tuple(absent), self.overflow, self.client)
        except BaseException:
            self.abort()
            raise
        finally:
            self._reset()  # the next step's hooks start afresh; the stream is the caller's now

    def abort(self) -> None:
        """Drop this step's push (cut before its end: nothing applied; the encoder's residuals
        as they were before it) and start afresh."""
        self._queue.join()
        self.client._land_pending()  # an open recording is then this step's, not an interrupted push's
        if self.stream is not None:
            self.stream.abort()
        if self.client.encoder.recording:  # (opening the push may have failed after begin())
            self.client.encoder.roll_back()
        self._reset()

    def close(self) -> None:
        """Remove the hooks, drop a push under way and stop the encoding thread."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.abort()
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

