"""The domain types that cross the wire, as plain frozen dataclasses (no protobuf here).

    key = PushKey("w0", incarnation=0x5eed, seq=7, digest=b"...16 bytes...")
    meta = PushMeta(job="lm", sender="w0", seq=7, base_version=41, incarnation=0x5eed)
    ack = Ack(applied_version=42, view_epoch=0x1f)

``ps.wire`` converts these to and from protobuf; every other module uses only these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from ps.config import JobConfig
    from ps.store import Layout

__all__ = ["PushKey", "PushMeta", "PullMeta", "VersionMeta", "Ack", "Registration"]


@dataclass(frozen=True)
class PushKey:
    """One worker push, end to end: who sent it (member, incarnation), which of its pushes
    (seq), and what it carried (the digest of its frames). Relays list the keys they sum."""

    member: str
    incarnation: int
    seq: int
    digest: bytes = b""


@dataclass(frozen=True)
class PushMeta:
    """A push's header: who, which push, computed on what, and how many gradients it sums."""

    job: str
    sender: str
    seq: int
    base_version: int
    view_epoch: int = 0
    contributors: int = 1
    clock_min: int = 0
    clock_max: int = 0
    clock_floor: int = 0
    loss_sum: float = 0.0          # training telemetry (see PushHeader): reported, never applied
    loss_count: int = 0
    step_seconds_sum: float = 0.0
    workers: int = 1               # live workers at or below the sender
    incarnation: int = 0           # the sender's process incarnation (as it registered)
    sources: tuple[PushKey, ...] = ()  # relays: the worker pushes the aggregate sums


@dataclass(frozen=True)
class PullMeta:
    view_epoch: int
    from_version: int
    to_version: int
    snapshot: bool
    server_epoch: int


@dataclass(frozen=True)
class VersionMeta:
    version: int
    checksum: int
    clock_min: int = 0
    contributors: int = 0


@dataclass(frozen=True)
class Ack:
    """A push's acknowledgement: the version that includes it."""

    applied_version: int
    view_epoch: int
    duplicate: bool = False


@dataclass(frozen=True)
class Registration:
    """What a tier answers a joining member."""

    config: JobConfig
    layout: Layout
    start_version: int
    server_epoch: int
    start_clock: int = 0
