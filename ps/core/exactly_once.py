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

import bisect
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ps.core.errors import BadInput, Conflict, short
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
    incarnation the book keeps the runs of push numbers it dropped (``[first, last]`` ranges;
    a sender's applied numbers are nearly always one run), so a key no longer found is known to
    have been applied at or before ``dropped_upto`` when its number lies in one (``forgotten``),
    and known not to have been applied otherwise. Without this a region that asked about its
    sync after an outage of more than ``horizon`` versions, or a relay after a root restart (a
    checkpoint keeps the newest 64 versions' records), was told "not applied" and sent it
    again: applied twice, and uncounted (its first record was gone). A forgotten key's body can
    no longer be compared: the same number with another body reads as that push (nothing is
    applied twice; a sender that reuses an applied number breaks the protocol). Bounded: at
    most ``senders`` sender incarnations (the oldest go) and ``_RUNS`` runs each (the lowest
    go); a key that went so reads as never applied, as every key past the horizon once did.

    >>> book, d = AppliedBook(horizon=2), bytes(16)
    >>> for v, seq in ((1, 1), (2, 2), (3, 4), (4, 5), (5, 6)):   # number 3 was never applied
    ...     _ = book.add(v, [PushKey("r1", 7, seq, d)])
    >>> book.lookup(PushKey("r1", 7, 1, d)), book.forgotten(PushKey("r1", 7, 1, d)), book.dropped_upto
    (None, True, 3)
    >>> [book.forgotten(PushKey("r1", 7, s, d)) for s in (3, 5, 7)], book.forgotten(PushKey("r1", 8, 1, d))
    ([False, False, False], False)
    """

    def __init__(self, horizon: int = 1024, senders: int = 1 << 16) -> None:
        self.horizon = horizon
        self._versions: OrderedDict[int, tuple[PushKey, ...]] = OrderedDict()
        self._where: dict[tuple[str, int, int], tuple[bytes, int]] = {}
        # (member, incarnation) -> the sorted, disjoint runs [first, last] of its push numbers
        # dropped from the horizon (each applied); the least recently dropped-to sender goes
        # past ``senders`` of them.
        self._dropped: OrderedDict[tuple[str, int], list[list[int]]] = OrderedDict()
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
            self._note_dropped(k.member, k.incarnation, k.seq, k.seq, version)

    def _note_dropped(self, member: str, incarnation: int, first: int, last: int, version: int) -> None:
        sender = (member, incarnation)
        runs = self._dropped.pop(sender, [])
        i = bisect.bisect_left(runs, [first])
        if i and runs[i - 1][1] + 1 >= first:  # joins the run before it
            i -= 1
            runs[i][1] = max(runs[i][1], last)
        else:
            runs.insert(i, [first, last])
        while i + 1 < len(runs) and runs[i][1] + 1 >= runs[i + 1][0]:  # and the runs after it
            runs[i][1] = max(runs[i][1], runs.pop(i + 1)[1])
        del runs[:-_RUNS]
        self._dropped[sender] = runs
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

    def applied_at(self, key: PushKey) -> int | None:
        """The version that applied ``key`` (``lookup``), or for one forgotten the newest version
        dropped (it was applied at or before it); None if it was never applied."""
        version = self.lookup(key)
        return self.dropped_upto if version is None and self.forgotten(key) else version

    def forgotten(self, key: PushKey) -> bool:
        """Whether ``key``, not held, is one the book dropped: applied at or before
        ``dropped_upto`` (its body can no longer be compared)."""
        if (key.member, key.incarnation, key.seq) in self._where:
            return False
        runs = self._dropped.get((key.member, key.incarnation), ())
        i = bisect.bisect_right(runs, [key.seq, math.inf]) - 1
        return i >= 0 and runs[i][0] <= key.seq <= runs[i][1]

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
        """The dropped runs, counting the records ``dump(last)`` leaves out as dropped:
        ``dropped_upto``, then per sender its member id, incarnation and runs."""
        copy = AppliedBook(self.horizon, self._senders)
        copy._dropped = OrderedDict((k, [list(r) for r in v]) for k, v in self._dropped.items())
        copy.dropped_upto = self.dropped_upto
        for v, keys in list(self._versions.items())[:-last] if last else self._versions.items():
            for k in keys:
                copy._note_dropped(k.member, k.incarnation, k.seq, k.seq, v)
        out = bytearray(_UPTO.pack(copy.dropped_upto))
        for (member, inc), runs in copy._dropped.items():
            m = member.encode()
            out += _SENDER.pack(len(m), inc, len(runs)) + m
            for first, last_ in runs:
                out += _RUN.pack(first, last_)
        return bytes(out)

    def load(self, data: bytes, dropped: bytes = b"") -> None:
        """What ``dump`` (and ``dump_dropped``) wrote; an older checkpoint has no runs."""
        if dropped:
            view = memoryview(dropped)
            if len(view) < _UPTO.size:
                raise BadInput(f"applied-push runs cut short: {len(view)} bytes")
            (upto,) = _UPTO.unpack_from(view)
            pos = _UPTO.size
            while pos < len(view):
                if pos + _SENDER.size > len(view):
                    raise BadInput(f"applied-push runs cut short at byte {pos}")
                n, inc, count = _SENDER.unpack_from(view, pos)
                pos += _SENDER.size
                if count > _RUNS or pos + n + count * _RUN.size > len(view):
                    raise BadInput(f"applied-push runs cut short (or {count} runs) at byte {pos}")
                try:
                    member = bytes(view[pos:pos + n]).decode()
                except UnicodeDecodeError:
                    raise BadInput(f"applied-push runs hold a member id that is not UTF-8 at byte {pos}") from None
                pos += n
                for _ in range(count):
                    first, last = _RUN.unpack_from(view, pos)
                    pos += _RUN.size
                    if not first <= last:
                        raise BadInput(f"applied-push run [{first}, {last}] of {short(member)} is not a run")
                    self._note_dropped(member, inc, first, last, upto)
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
_SENDER = struct.Struct("<HQI")  # member length, incarnation, runs
_RUN = struct.Struct("<QQ")  # first, last push number of a run
_RUNS = 64  # runs kept per sender


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
