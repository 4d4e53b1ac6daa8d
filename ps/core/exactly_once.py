"""Exactly-once bookkeeping (invariant 4), pure: per-sender sequence books, the root's record
of applied worker pushes, and a compact encoding of push keys for the write-ahead log.

>>> digest = bytes(16)                # the push body's digest
>>> book = SeqBook(incarnation=0x5eed)
>>> book.classify(1)
'new'
>>> book.accept(1, digest)           # in a round now
>>> book.settle(1, ack="ack of v42") # applied: a retry with the same body gets this ack
>>> book.classify(1), book.ack_of(1)
('duplicate', 'ack of v42')
>>> applied = AppliedBook(horizon=1024)
>>> applied.add(version=42, keys=[PushKey("w0", 0x5eed, 1, digest)])    # no double applications
0
>>> applied.lookup(PushKey("w0", 0x5eed, 1, digest))
42

A push is one sender incarnation's sequence number with one body (its digest). A retry is
recognised only when all three match; the same number with another body is refused. A new
incarnation of a member id (a restarted process) starts a new book, so its pushes can never be
taken for the old incarnation's. Relays sum pushes, so the root also records which *worker*
pushes (``PushKey``) each version applied: a relay that restarted, or a root that restarted,
can then still tell a retry that was applied from one that was not.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ps.core.errors import BadInput, Conflict
from ps.core.types import PushKey, StepInfo

__all__ = ["SeqBook", "AppliedBook", "Unanswered", "encode_keys", "decode_keys", "encode_applied",
           "decode_applied", "MAX_IN_FLIGHT"]

# async: the most pushes one sender (worker or relay) keeps in flight at once. One at a time
# made a push wait for the previous one's acknowledgement from the root at every tier:
# measured 0.35-0.73 s per push through zone, region and root on the demo, and gradients
# applied ~7 versions after the one they were computed on.
MAX_IN_FLIGHT = 4


@dataclass
class SeqBook:
    """One sender incarnation's pushes at one tier.

    ``classify(seq)``: "duplicate" (acknowledged: answer with the recorded ack, apply nothing),
    "pending" (in a batch not yet decided: share its outcome), "retry" (accepted before but
    refused, never applied: decide afresh) or "new". A sender reuses a number until it is
    acknowledged; an async sender may have up to MAX_IN_FLIGHT numbers out at once, which can
    arrive out of order. A number further ahead than that is a bug or an attack.
    """

    incarnation: int = 0
    highest: int = 0
    acks: OrderedDict = field(default_factory=OrderedDict)  # seq -> (ack, digest)
    pending: dict[int, bytes] = field(default_factory=dict)  # seq -> digest
    keep: int = 64

    def classify(self, seq: int) -> str:
        if seq == 0:
            raise BadInput("push sequence numbers start at 1; got 0")
        if seq in self.acks:
            return "duplicate"
        if seq in self.pending:
            return "pending"
        # Slack beyond MAX_IN_FLIGHT: windows aborted by a reset still retry while new ones go.
        if seq > self.highest + 4 * MAX_IN_FLIGHT:
            raise BadInput(f"push sequence {seq} is from the future: the last one seen from this "
                           f"sender is {self.highest}; sequences increase by one, with at most "
                           f"{MAX_IN_FLIGHT} pushes in flight at a time")
        return "retry" if seq <= self.highest else "new"

    def check_body(self, seq: int, digest: bytes) -> None:
        """Conflict unless ``digest`` is the body recorded for ``seq`` (acked or pending)."""
        known = self.acks[seq][1] if seq in self.acks else self.pending.get(seq)
        if known is not None and known != digest:
            state = "was applied" if seq in self.acks else "is in a round"
            raise Conflict(f"push {seq} of this sender {state} with another body; a retry must resend "
                           "the same push (a new gradient takes the next sequence number)")

    def ack_of(self, seq: int) -> Any:
        return self.acks[seq][0]

    def accept(self, seq: int, digest: bytes) -> None:
        """The push is in a batch now."""
        self.highest = max(self.highest, seq)
        self.pending[seq] = digest

    def settle(self, seq: int, ack: Any = None) -> None:
        """The push's batch was decided: applied (``ack``) or refused (None: never applied)."""
        digest = self.pending.pop(seq, b"")
        if ack is not None:
            self.acks[seq] = (ack, digest)
            while len(self.acks) > self.keep:
                self.acks.popitem(last=False)


class AppliedBook:
    """The worker pushes the last ``horizon`` versions applied, by key (the root keeps one per
    job; its checkpoints and write-ahead log carry it across restarts).

    Past the horizon a key is *forgotten*, never taken for "not applied": for each sender
    incarnation the book keeps the highest push number it dropped, so a key no longer found is
    known to have been applied at or before ``dropped_upto`` when its number is at most that
    (``forgotten``), and known not to have been applied when it is above it (an applied push
    above it would still be held). Without this a region that asked about its sync after an
    outage of more than ``horizon`` versions, or a relay after a root restart (a checkpoint
    keeps the newest 64 versions' records), was told "not applied" and sent it again: applied
    twice, and uncounted (its first record was gone). The safe side: a number at most the mark
    that was in fact never applied (given up on while later ones were applied and aged out) is
    lost, never acknowledged; none is applied twice, and one applied again is counted.

    >>> book, d = AppliedBook(horizon=2), bytes(16)
    >>> for v in (1, 2, 3):
    ...     _ = book.add(v, [PushKey("r1", 7, v, d)])
    >>> book.lookup(PushKey("r1", 7, 1, d)), book.forgotten(PushKey("r1", 7, 1, d)), book.dropped_upto
    (None, True, 1)
    >>> book.forgotten(PushKey("r1", 7, 4, d)), book.forgotten(PushKey("r1", 8, 1, d))  # newer; another incarnation
    (False, False)
    """

    def __init__(self, horizon: int = 1024, senders: int = 1 << 16) -> None:
        self.horizon = horizon
        self._versions: OrderedDict[int, tuple[PushKey, ...]] = OrderedDict()
        self._where: dict[tuple[str, int, int], tuple[bytes, int]] = {}
        # (member, incarnation) -> the highest push number of it dropped from the horizon; the
        # oldest senders go past ``senders`` of them (bounded memory; their keys then read as
        # never applied, as every key past the horizon did before).
        self._dropped: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._senders = senders
        self.dropped_upto = 0  # the newest version whose record was dropped

    def __len__(self) -> int:
        return len(self._where)

    def add(self, version: int, keys: Iterable[PushKey]) -> int:
        """Record what ``version`` applied; returns how many of ``keys`` an earlier version had
        applied already (a double application: it must always be 0, and the root exports it)."""
        keys = tuple(keys)
        if not keys:
            return 0
        self._versions[version] = keys
        doubles = 0
        for k in keys:
            where = (k.member, k.incarnation, k.seq)
            doubles += (where in self._where and self._where[where][1] != version) or self.forgotten(k)
            self._where[where] = (k.digest, version)
        while self._versions and next(iter(self._versions)) <= version - self.horizon:
            self._drop(*self._versions.popitem(last=False))
        return doubles

    def _drop(self, version: int, keys: tuple[PushKey, ...]) -> None:
        for k in keys:
            where = (k.member, k.incarnation, k.seq)
            if self._where.get(where, (b"", None))[1] == version:
                del self._where[where]
            self._note_dropped(k.member, k.incarnation, k.seq, version)

    def _note_dropped(self, member: str, incarnation: int, seq: int, version: int) -> None:
        sender = (member, incarnation)
        self._dropped[sender] = max(self._dropped.pop(sender, 0), seq)
        while len(self._dropped) > self._senders:
            self._dropped.popitem(last=False)
        self.dropped_upto = max(self.dropped_upto, version)

    def lookup(self, key: PushKey) -> int | None:
        """The version that applied ``key``, None if none in the horizon did (see ``forgotten``
        for one applied before it); Conflict if one applied the same sender's push number with
        another body."""
        hit = self._where.get((key.member, key.incarnation, key.seq))
        if hit is None:
            return None
        if hit[0] != key.digest:
            raise Conflict(f"push {key.seq} of {key.member!r} was applied (version {hit[1]}) with "
                           "another body")
        return hit[1]

    def forgotten(self, key: PushKey) -> bool:
        """Whether ``key``, not held, is one the book dropped: applied at or before
        ``dropped_upto`` (its body can no longer be compared)."""
        if (key.member, key.incarnation, key.seq) in self._where:
            return False
        return key.seq <= self._dropped.get((key.member, key.incarnation), 0)

    def dump(self, last: int) -> bytes:
        """The newest ``last`` versions' records as bytes (what a checkpoint keeps: a retry that
        outlives a root restart refers to the versions just before it). ``dump_dropped(last)``
        is what the book knows of the others."""
        out = bytearray()
        for v, keys in list(self._versions.items())[-last:]:
            body = encode_keys(keys)
            out += _VERSION.pack(v, len(body)) + body
        return bytes(out)

    def dump_dropped(self, last: int) -> bytes:
        """The dropped-push marks, counting the records ``dump(last)`` leaves out as dropped:
        ``dropped_upto`` then one key per sender (member, incarnation, highest number dropped;
        no digest)."""
        copy = AppliedBook(self.horizon, self._senders)
        copy._dropped, copy.dropped_upto = OrderedDict(self._dropped), self.dropped_upto
        for v, keys in list(self._versions.items())[:-last] if last else self._versions.items():
            for k in keys:
                copy._note_dropped(k.member, k.incarnation, k.seq, v)
        return _UPTO.pack(copy.dropped_upto) + encode_keys(
            PushKey(m, inc, seq, b"") for (m, inc), seq in copy._dropped.items())

    def load(self, data: bytes, dropped: bytes = b"") -> None:
        """What ``dump`` (and ``dump_dropped``) wrote; an older checkpoint has no marks."""
        if dropped:
            if len(dropped) < _UPTO.size:
                raise BadInput(f"applied-push marks cut short: {len(dropped)} bytes")
            (upto,) = _UPTO.unpack_from(dropped)
            for k in decode_keys(dropped[_UPTO.size:]):
                self._note_dropped(k.member, k.incarnation, k.seq, upto)
        pos, view = 0, memoryview(data)
        while pos < len(view):
            if pos + _VERSION.size > len(view):
                raise BadInput(f"applied-push record cut short at byte {pos}")
            v, n = _VERSION.unpack_from(view, pos)
            pos += _VERSION.size
            if pos + n > len(view):  # a slice would quietly load the keys that are there
                raise BadInput(f"applied-push record of version {v} cut short: {n} bytes of keys "
                               f"declared, {len(view) - pos} present")
            self.add(v, decode_keys(bytes(view[pos:pos + n])))
            pos += n

    def clear(self) -> None:
        self._versions.clear()
        self._where.clear()
        self._dropped.clear()
        self.dropped_upto = 0


_KEY = struct.Struct("<HQQB")  # member length, incarnation, seq, digest length
_VERSION = struct.Struct("<QI")  # version, length of its encoded keys
_UPTO = struct.Struct("<Q")  # the newest version dropped


class Unanswered:
    """A relay's forwards given up on unanswered (its round timeout passed with the outcome
    unknown), per job: the parent may still apply one after the children were told it failed.
    Until the root says what became of it, its sequence number goes to no other body and its
    worker pushes are not placed again (a child's retry asks the root first). Those the root
    applied stay "spent" (the newest ``keep`` per job), so a later retry of one of their pushes
    still asks, and gets the version that applied it.

    >>> u, a, b = Unanswered(), PushKey("a", 1, 7, bytes(16)), PushKey("b", 1, 3, bytes(16))
    >>> u.gave_up("lm", seq=4, keys=(a, b))
    >>> u.holds("lm", (PushKey("b", 1, 3, bytes(16)),)), u.pending("lm")[0][0]
    (True, 4)
    >>> u.settled("lm", (b,), applied=True)        # one push of it answered: the whole forward
    [4]
    >>> u.pending("lm"), u.holds("lm", (a,))       # its number is spent; a's retry still asks
    ([], True)
    """

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._unsure: dict[str, dict[int, tuple[PushKey, ...]]] = {}
        self._spent: dict[str, dict[int, tuple[PushKey, ...]]] = {}

    def gave_up(self, job: str, seq: int, keys: tuple[PushKey, ...]) -> None:
        self._record(self._unsure.setdefault(job, {}), seq, keys)

    def pending(self, job: str) -> list[tuple[int, tuple[PushKey, ...]]]:
        """The forwards of ``job`` whose outcome is still unknown, oldest first."""
        return sorted(self._unsure.get(job, {}).items())

    def forget(self, job: str, seq: int) -> None:
        """Drop forward ``seq`` unsettled (an empty one: nothing in it to apply twice)."""
        self._unsure.get(job, {}).pop(seq, None)

    def holds(self, job: str, keys: tuple[PushKey, ...]) -> bool:
        """Whether any of these worker pushes was in a forward given up on (settled or not)."""
        mine = {(k.member, k.incarnation, k.seq) for k in keys}
        held = [*self._unsure.get(job, {}).values(), *self._spent.get(job, {}).values()]
        return any((k.member, k.incarnation, k.seq) in mine for ks in held for k in ks)

    def settled(self, job: str, keys: tuple[PushKey, ...], applied: bool) -> list[int]:
        """The root answered for these pushes: the forwards that held one are settled (a forward
        is applied whole or not at all). Returns their numbers; ``applied`` ones are spent."""
        held = self._unsure.get(job, {})
        mine = {(k.member, k.incarnation, k.seq) for k in keys}
        done = [seq for seq, ks in held.items() if any((k.member, k.incarnation, k.seq) in mine for k in ks)]
        for seq in done:
            ks = held.pop(seq)
            if applied:
                self._record(self._spent.setdefault(job, {}), seq, ks)
        return done

    def drop(self, job: str) -> None:
        self._unsure.pop(job, None)
        self._spent.pop(job, None)

    def _record(self, held: dict[int, tuple[PushKey, ...]], seq: int, keys: tuple[PushKey, ...]) -> None:
        # Bounded: an async job's forwards given up on are settled only by their children's retries.
        held[seq] = keys
        for old in sorted(held)[:-self.keep]:
            del held[old]


def encode_keys(keys: Iterable[PushKey]) -> bytes:
    """Push keys as compact bytes (the write-ahead log and checkpoints store these)."""
    out = bytearray()
    for k in keys:
        m = k.member.encode()
        out += _KEY.pack(len(m), k.incarnation, k.seq, len(k.digest)) + m + k.digest
    return bytes(out)


def decode_keys(data: bytes) -> tuple[PushKey, ...]:
    out, pos, view = [], 0, memoryview(data)
    while pos < len(view):
        if pos + _KEY.size > len(view):
            raise BadInput(f"push keys cut short at byte {pos} of {len(view)}")
        n, inc, seq, d = _KEY.unpack_from(view, pos)
        pos += _KEY.size
        if pos + n + d > len(view):
            raise BadInput(f"push keys cut short at byte {pos} of {len(view)}")
        try:
            member = bytes(view[pos:pos + n]).decode()
        except UnicodeDecodeError:
            raise BadInput(f"push keys hold a member id that is not UTF-8 at byte {pos}") from None
        out.append(PushKey(member, inc, seq, bytes(view[pos + n:pos + n + d])))
        pos += n + d
    return tuple(out)


# A version's record: its step information (JSON), marked by a zero member length no push key
# has, then its push keys. Records without the mark (written before step information) decode
# with an empty step.
_STEP = struct.Struct("<HI")  # 0, length of the step's JSON


def encode_applied(keys: Iterable[PushKey], step: StepInfo) -> bytes:
    """What the root's log records about a version beyond its gradient: the pushes it applied
    and the step information they carried.

    >>> step = StepInfo(hparams=((0, "lr", 0.05),), progress=((0, 3, 128),))
    >>> blob = encode_applied((PushKey("w0", 1, 2, bytes(16)),), step)
    >>> keys, got = decode_applied(blob)
    >>> keys[0].member, got == step, decode_applied(encode_keys(keys)) == (keys, StepInfo())
    ('w0', True, True)
    """
    body = encode_keys(keys)
    if step.inner_rate:  # it steers the regions; it is not part of what the version applied
        step = replace(step, inner_rate=0.0)
    if step.empty:
        return body
    data = json.dumps([step.hparams, step.absent, step.skip, step.buffers, step.progress],
                      separators=(",", ":")).encode()
    return _STEP.pack(0, len(data)) + data + body


def decode_applied(data: bytes) -> tuple[tuple[PushKey, ...], StepInfo]:
    if len(data) >= 2 and data[0] == 0 and data[1] == 0:
        if len(data) < _STEP.size:
            raise BadInput("a version record's step information is cut short")
        _, n = _STEP.unpack_from(data)
        if _STEP.size + n > len(data):
            raise BadInput(f"a version record's step information declares {n} bytes, "
                           f"{len(data) - _STEP.size} present")
        try:
            h, a, skip, buffers, progress = json.loads(data[_STEP.size:_STEP.size + n])
            step = StepInfo(tuple((int(g), str(k), float(v)) for g, k, v in h), tuple(int(i) for i in a),
                            bool(skip), int(buffers), tuple((int(e), int(s), int(x)) for e, s, x in progress))
        except (ValueError, TypeError) as exc:
            raise BadInput(f"a version record's step information does not decode: {exc}") from None
        return decode_keys(data[_STEP.size + n:]), step
    return decode_keys(data), StepInfo()
