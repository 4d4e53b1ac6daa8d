"""A hot-standby root: it follows its primary's write-ahead log and takes over when it is gone.

    hps serve --role global --checkpoint-dir /var/lib/hps-b --standby-of root-a:7000

The standby asks the primary to Follow (``ps.net.follow``). The primary sends its term and its
view epoch, each job's checkpoint (and declared and ended jobs), SYNCED, then every log record
as it is made, before it publishes or acknowledges that version (``ps.tiers.replication``). The
standby writes what it gets to its own checkpoint directory, appends each record to its own log
(fsync) and applies it with the arithmetic of a replay (``Root._apply``), then acknowledges it.
So it holds the same versions, checksums, delta log and view epoch as the primary: children
that move to it resume from deltas. It serves reads (Pull, Status) and refuses writes.

Takeover. When the primary has said nothing for the lease and answers no Status within it,
a standby that is in sync (it acknowledged SYNCED, durably noted) promotes itself: its term
rises by one, written durably before it accepts a push (``hps promote ADDR`` does the same on
demand). The old primary cannot acknowledge anything meanwhile (no follower acknowledges its
records), and a root whose peer is a primary of a higher term refuses pushes and rejoins as its
standby, dropping its own state for the new primary's checkpoint. The term and the role are in
``ROOT.json`` in the checkpoint directory.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> read_role(d, default="standby")
{'term': 0, 'state': 'standby', 'synced': False, 'sync': True}
>>> write_role(d, term=2, state="primary", synced=False, sync=False)
>>> read_role(d, default="standby")["term"]
2
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ps.core.errors import HpsError, Unavailable
from ps.core.logs import event
from ps.core.types import LogMessage
from ps.net.follow import LogLink
from ps.tiers import checkpoint
from ps.tiers.walrecord import from_bytes

if TYPE_CHECKING:
    from ps.tiers.root import Root

__all__ = ["Standby", "read_role", "write_role"]

log = logging.getLogger("hps.standby")

ROLE_FILE = "ROOT.json"


def read_role(directory: str, default: str) -> dict:
    """The durable role: term, state (primary, standby), synced (a standby holds the whole
    root), sync (a primary acknowledges only with a standby)."""
    out = dict(term=0, state=default, synced=False, sync=True)
    path = Path(directory) / ROLE_FILE
    if path.exists():
        out.update(json.loads(path.read_text()))
    return out


def write_role(directory: str, **role) -> None:
    """Atomically and durably (the term fences: it must never go back)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (ROLE_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(role))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / ROLE_FILE)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Standby:
    """The follow loop of a standby root, and what it does with each message."""

    def __init__(self, root: Root, primary: str, token: str = "") -> None:
        self.root = root
        self.primary = primary
        self.link = LogLink(primary, root.tls, token)
        self.lease_s = root.config.lease_s
        self.last_contact = time.monotonic()
        self.connected = False
        self._seen: set[str] = set()  # jobs this bootstrap sent
        # Held while a message is handled: a promotion cancels following between two messages,
        # never after a record's append and before its apply (the log one version ahead of the
        # parameters: the first round after taking over then found the job damaged).
        self.busy = asyncio.Lock()

    async def run(self) -> None:
        """Follow until promoted (or cancelled): reconnect after every break, and take over once
        the primary has been unreachable for the lease."""
        pause = min(0.1, self.lease_s / 10)
        while True:
            try:
                await self.link.follow(self.root.term, self.lease_s, self._handle, self.root.address)
                why = "the primary ended the stream"
            except (HpsError, OSError, ValueError) as exc:
                why = str(exc)
            except Exception as exc:  # a bug here must not end following (and taking over) for good
                log.exception("following the primary %s failed; following it again", self.primary)
                why = f"{type(exc).__name__}: {exc}"
            self.connected = False
            if time.monotonic() - self.last_contact >= self.lease_s and self.root.role_state["synced"]:
                if not await self._reachable():
                    await self.root.promote(f"the primary {self.primary} was unreachable for "
                                            f"{time.monotonic() - self.last_contact:.1f}s ({why})")
                    return
            await asyncio.sleep(pause)

    async def _reachable(self) -> bool:
        try:
            await self.link.status(timeout=min(1.0, self.lease_s))
            return True
        except (HpsError, OSError):
            return False

    async def _handle(self, m: LogMessage) -> None:
        async with self.busy:
            await self._handle_one(m)

    async def _handle_one(self, m: LogMessage) -> None:
        self.last_contact = time.monotonic()
        root = self.root
        if m.kind == "hello":
            if m.term < root.term:
                raise Unavailable(f"{self.primary} holds term {m.term}, older than this root's {root.term}")
            self.connected = True
            self._seen = set()
            await self._writers_done(None)
            root.reset_for_follow(m.term, m.epoch)
            log.info("following the primary %s (term %d): receiving its state", self.primary, m.term,
                     extra=event("standby.following", term=m.term))
        elif m.kind == "tokens":  # every job's token hash, after "hello"
            if root.tokens is not None:
                hashes = {j: bytes.fromhex(h) for j, h in json.loads(m.data).items()}
                await asyncio.to_thread(root.tokens.replace, hashes)
        elif m.kind == "token":  # one job's, as its creator is given it
            if root.tokens is not None:
                await asyncio.to_thread(root.tokens.set_hash, m.job, m.data)
        elif m.kind == "state":
            held = root.jobs.get(m.job)  # sent twice (announced at its creation, then bootstrapped)
            if held is not None and held.wal is not None:
                held.wal.close()  # its files are replaced next
            await self._writers_done(m.job)
            await asyncio.to_thread(self._write_state, m)
            js = root._load(Path(root._job_dir(m.job)))
            if js is None:
                raise ValueError(f"the checkpoint of job {m.job} did not load")
            self._seen.add(m.job)
        elif m.kind == "roster":
            js = root.jobs.get(m.job)
            if js is not None:
                roster = json.loads(m.data)
                await asyncio.to_thread(checkpoint.write_atomic, Path(root._job_dir(m.job)) / "roster.json", m.data)
                js.ranks.load(roster.get("ranks", []))
                js.leases.load({"dataset": roster.get("dataset"), "leases": roster.get("leases", []),
                                "open": roster.get("open", [])},
                               root.clock())
                js.roster_saved = roster
        elif m.kind == "kept":  # the primary could not restore it: this copy stays as it is
            self._seen.add(m.job)
            if (Path(root._job_dir(m.job))).exists():
                log.error("job %s: the primary %s could not restore it, so it is not served; this standby keeps "
                          "its own copy of its files (restore the primary's from them, or promote this root "
                          "and restart it to serve the job)", m.job, self.primary,
                          extra=event("standby.kept", job=m.job))
        elif m.kind == "declared":
            self._seen.add(m.job)
            await self._writers_done(m.job)
            await asyncio.to_thread(self._wipe, m.job)
            root.follow_declared(json.loads(m.data))
        elif m.kind == "ended":
            self._seen.add(m.job)
            info = json.loads(m.data)
            js = root.jobs.pop(m.job, None)
            if js is not None and js.wal is not None:
                js.wal.close()
            await self._writers_done(m.job)
            await asyncio.to_thread(self._wipe, m.job)
            if root.tokens is not None:
                await asyncio.to_thread(root.tokens.set_hash, m.job, b"")
            root.follow_ended(m.job, info)
        elif m.kind == "record":
            js = root.jobs.get(m.job)
            if js is None:  # the stream broke its order: follow again, from a fresh bootstrap
                raise ValueError(f"a record of job {m.job}, whose state this standby was not sent")
            rec = from_bytes(m.data)
            if rec.version != js.view.version + 1:
                raise ValueError(f"job {m.job}: record of version {rec.version} after version {js.view.version}")
            await asyncio.to_thread(js.wal.append, rec)  # durable before acknowledged
            root._apply(js, rec)
            if js.view.version % root.config.checkpoint_every == 0:
                root._checkpoint(js)
        elif m.kind == "synced":
            stale = [d.name for d in Path(root.config.checkpoint_dir).glob("*/") if d.name not in self._seen]
            for name in stale:
                await asyncio.to_thread(self._wipe, name)
            root.set_role(synced=True)
            log.info("in sync with the primary %s: %d job(s) at term %d", self.primary, len(root.jobs),
                     root.term, extra=event("standby.synced", term=root.term))

    async def _writers_done(self, job: str | None) -> None:
        """Wait for the checkpoints of ``job`` (None: of every job) still being written, from
        records before: one that finished after its directory was wiped or rewritten would put
        back a state the primary no longer holds (a version it never made durable), which a
        restart of this root, promoted meanwhile, would restore under the versions it served."""
        mine = [t for t in self.root._ckpt_tasks if job is None or getattr(t, "job", None) == job]
        if mine:
            await asyncio.gather(*mine, return_exceptions=True)

    def _wipe(self, job: str) -> None:
        shutil.rmtree(self.root._job_dir(job), ignore_errors=True)

    def _write_state(self, m: LogMessage) -> None:
        self._wipe(m.job)
        checkpoint.save_bytes(self.root._job_dir(m.job), m.version, m.data, self.root.config.checkpoint_keep)
