"""The root's side of a hot-standby pair (issue 15): which of the two roots is the primary,
taking over, and serving the standby the state and then the records it follows.

``Pairing`` is mixed into ``ps.tiers.root.Root`` (it uses the root's jobs, its checkpoint state
and its durable role); ``ps.tiers.standby`` is the standby's side of the same stream and
``ps.tiers.replication`` the bookkeeping of acknowledged records in between. A root without a
peer (``--standby``/``--standby-of``) is the primary from the start and none of this runs
beyond ``writable()``.

At start a root with a peer asks the peer what it is: a primary of a newer term (or any
primary, when this root was not the primary last) makes this root its standby; else it serves
as the primary of its durable term. A standby that takes over (``promote``) starts a new term,
durable before any push is accepted; a deposed primary finds the newer term through its peer
and rejoins as a standby.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

from ps.core.errors import Conflict, HpsError, NotPrimary, NotReady, Unavailable
from ps.core.logs import event
from ps.core.types import LogMessage, TierStatus
from ps.net.follow import LogLink
from ps.tiers import checkpoint
from ps.tiers.replication import Follower, Replication
from ps.tiers.standby import Standby, write_role
from ps.tiers.tier import new_epoch

__all__ = ["Pairing"]

log = logging.getLogger("hps.root")


class Pairing:
    """Primary or standby: mixed into ``Root`` before ``Tier``."""

    async def start(self) -> None:
        await super().start()
        self._tasks.append(asyncio.create_task(self._watch_peer(), name="watch-peer"))
        if not self.peer:
            return
        peer = await self._peer_status(wait_s=self.config.lease_s)
        if peer is not None and peer.root_state == "primary" and (
                peer.term > self.term or self.role_state["state"] != "primary"):
            self._follow(self.peer, f"{self.peer} is the primary (term {peer.term})", peer.term)
        elif self.role_state["state"] == "primary":
            self.state = "primary"
            self.set_role(state="primary")
            log.info("serving as the primary root (term %d; standby %s %s)", self.term, self.peer,
                     "required" if self.replication.required else "optional until in sync",
                     extra=event("root.primary", term=self.term))
        else:
            self._follow(self.peer, "configured as a standby")

    async def _peer_status(self, wait_s: float) -> TierStatus | None:
        link = LogLink(self.peer, self.tls, self._token)
        deadline = self.clock() + wait_s
        try:
            while True:
                try:
                    return await link.status(timeout=max(0.2, min(1.0, deadline - self.clock())))
                except (HpsError, OSError):
                    if self.clock() >= deadline:
                        return None
                    await asyncio.sleep(0.1)
        finally:
            await link.close()

    async def _watch_peer(self) -> None:
        """A primary that has lost its standby asks its peer what it is: a primary of a higher
        term deposed this one, which then rejoins as its standby."""
        while True:
            await asyncio.sleep(self.config.lease_s / 2)
            if not self.peer or self.state not in ("primary", "fenced") or self.replication.in_sync():
                continue
            peer = await self._peer_status(wait_s=0)
            if peer is not None and peer.root_state == "primary" and peer.term > self.term:
                self._follow(self.peer, f"{self.peer} took over with term {peer.term}", peer.term)

    def _follow(self, primary: str, why: str, term: int = 0) -> None:
        """Become (or stay) the standby of ``primary``: what this root holds is replaced by the
        primary's checkpoints as they arrive. ``term``: the primary's, when known; a higher one
        is taken on at once and durably (this root is fenced by it before its stream starts)."""
        if self.state == "primary":
            log.warning("this root is no longer the primary (%s); it rejoins as a standby", why,
                        extra=event("root.deposed", term=self.term))
        self.state = "standby"
        self.term = max(self.term, term)
        self.set_role(state="standby", synced=self.role_state["synced"] and self.state == "standby")
        if self.replication.follower is not None:
            self.replication.detach(self.replication.follower, "this root is now a standby")
        self.standby = Standby(self, primary, self._token)
        self._standby_task = asyncio.create_task(self.standby.run(), name="standby")
        self._tasks.append(self._standby_task)

    def set_role(self, **change) -> None:
        self.role_state = {**self.role_state, **change, "term": self.term}
        if self.config.checkpoint_dir:
            write_role(self.config.checkpoint_dir, **self.role_state)

    def writable(self) -> None:
        """Refuse what only a primary does (pushes, joins, jobs, ranks, leases), and all of it
        once this root is stopping: its last checkpoint empties the log, and a version applied
        after it would be in the log only (what an older release, rolled back to, cuts)."""
        if self._stopping:
            raise Unavailable("this root is stopping; retry (a restarted or standby root answers)")
        if self.state == "primary":
            return
        if self.state == "standby":
            raise NotPrimary(f"this root is the standby of {self.peer} (it takes over when that one is "
                             "gone); send this to the primary")
        raise NotPrimary(f"this root is not the primary (it is {self.state}); send this to the primary")

    async def promote(self, why: str, force: bool = False) -> int:
        """Take over: a new term, durable before any push is accepted. A standby not in sync
        (taking its primary's state, or never given it) only with ``force``: it may hold less
        than its primary acknowledged, and that primary, back, follows it and drops the rest."""
        if self.state == "primary":
            return self.term
        unsynced = self.state == "standby" and not self.role_state["synced"]
        if unsynced and not force:
            raise NotReady("this standby does not hold its primary's whole state (it is still taking it, or never "
                           "had it): promoted, it would serve less than the primary acknowledged, and the old "
                           "primary would drop the rest when it comes back as its standby. Wait until it is in "
                           "sync (hps_root_standby_in_sync), or give --force if the primary's volume is lost")
        if self._standby_task is not None and self._standby_task is not asyncio.current_task():
            if self.standby is not None:
                async with self.standby.busy:  # between two messages (ps.tiers.standby)
                    self._standby_task.cancel()
            else:
                self._standby_task.cancel()
            await asyncio.gather(self._standby_task, return_exceptions=True)
        self._standby_task = self.standby = None
        self.term += 1
        self.set_role(state="primary", synced=False, sync=False)  # alone until a standby is in sync
        self.replication = Replication(self.config.lease_s, required=False)
        self.state = "primary"
        if unsynced:
            # It may hold fewer versions than the old primary published: it would publish other
            # values under the same (epoch, version) numbers, and a child at such a version
            # (whose "up to date" answer carries no checksum) kept the old ones. A new lineage:
            # every child takes a snapshot, every push on the old one is told to pull.
            self.epoch = new_epoch()
            for js in self.jobs.values():
                js.view.epoch = self.epoch
                js.log.clear()
        for js in self.jobs.values():
            js.reset_round(js.view.version, "promoted")
            # Renewals went to the old primary only (they change no roster): each holder gets a
            # full lease timeout here, as a restart gives it, or its healthy holder lost its shard
            # to the next worker that asked (review).
            js.leases.renew_all(self.clock())
        log.warning("promoted to primary with term %d: %s; %d job(s) at versions %s", self.term, why,
                    len(self.jobs), {n: js.view.version for n, js in self.jobs.items()},
                    extra=event("root.promoted", term=self.term))
        return self.term

    def synced(self) -> bool:
        """Readiness. A primary is ready; a standby once it holds its primary's whole state on a
        live Follow stream (a rollout that replaced the primary next, while the standby was still
        catching up, would stop training until the primary came back: no takeover without it);
        a root still deciding what it is, or fenced and looking for the new primary, is not."""
        if self.state == "standby":
            return bool(self.standby is not None and self.standby.connected and self.role_state["synced"])
        return self.state == "primary"

    def reset_for_follow(self, term: int, epoch: int) -> None:
        """A new Follow stream: the primary's term and view epoch; every job comes again."""
        for js in self.jobs.values():
            js.abort("this root is following a new primary: push to it (the outcome is resolved there)",
                     NotPrimary)
            if js.wal is not None:
                js.wal.close()
        self.jobs.clear()
        self.declared.clear()
        self.declared_at.clear()
        self.ended.clear()
        self.ended_configs.clear()
        self.damaged.clear()
        self.term, self.epoch = term, epoch
        self.set_role(state="standby", synced=False)

    def follow(self, term: int, address: str = "") -> Follower:
        """A standby asks to follow this root (the Follow RPC): its follower, being sent the
        state to start from (``_bootstrap``), then every record."""
        if term > self.term:
            raise Conflict(f"the standby holds term {term}, newer than this root's {self.term}: this root "
                           "was deposed; it rejoins as a standby")
        if self._stopping:  # a follower attached now would hold stop() up (its beats never end)
            raise Unavailable("this root is stopping; follow it again once it is back")
        self.writable()
        if address and not self.peer:  # where to look for a newer primary once this follower is gone
            self.peer = address
        f = self.replication.attach(term)
        # First on the stream, now: a job created before the bootstrap task runs announces its
        # state to this follower, and the standby's "hello" would wipe it (records of the job
        # would then reach a standby that does not hold it).
        f.send(LogMessage("hello", term=self.term, epoch=self.epoch))
        task = asyncio.create_task(self._bootstrap(f), name="bootstrap-standby")
        self._ckpt_tasks.add(task)
        task.add_done_callback(self._ckpt_tasks.discard)
        return f

    async def _bootstrap(self, f: Follower) -> None:
        try:
            tokens = self.tokens.hashes() if self.tokens is not None else {}
            f.send(LogMessage("tokens", data=json.dumps({j: h.hex() for j, h in tokens.items()}).encode()))
            for cfg in list(self.declared.values()):
                f.send(LogMessage("declared", job=cfg.name, data=json.dumps(dataclasses.asdict(cfg)).encode()))
            for name, version in list(self.ended.items()):
                cfg = self.ended_configs.get(name, (None, 0))[0]
                f.send(LogMessage("ended", job=name, version=version, data=json.dumps(dict(
                    version=version, config=dataclasses.asdict(cfg) if cfg else None)).encode()))
            for name in [n for n in self.damaged if n not in self.jobs]:
                # Not restored at start-up (its files damaged here): the standby's copy may be the
                # only good one of its acknowledged versions, and it wipes what it is not sent.
                f.send(LogMessage("kept", job=name))
            for name, js in list(self.jobs.items()):
                async with js.apply_lock:  # no version in the middle: records after it follow it
                    if self.jobs.get(name) is not js or not f.alive:
                        continue
                    source = js
                    if name in self.damaged:
                        # Not served: its state in memory is suspect (a version logged, never
                        # published). The standby gets what the disk holds: what a restart serves.
                        try:
                            source = self._load(Path(self._job_dir(name)), register=False)
                        except Exception as exc:
                            source = None
                            log.error("job %s (not served) is not sent to the standby: its disk cannot be "
                                      "read (%s)", name, exc)
                        if source is None:  # the standby keeps its own copy, as of a job not restored
                            f.send(LogMessage("kept", job=name))
                            continue
                    arrays, meta = self._ckpt_state(source)
                    data = await asyncio.to_thread(checkpoint.to_bytes, arrays, meta)
                    f.jobs[name] = f.send(LogMessage("state", job=name, version=js.view.version, data=data))
                    if js.roster_saved:
                        f.send(LogMessage("roster", job=name, data=json.dumps(js.roster_saved).encode()))
            # Durable before the standby may call itself in sync (it writes that before its ack):
            # a root killed between the two came back acknowledging alone, while its standby,
            # cut off from it, could take over; two primaries. From here none acknowledges alone.
            if not f.alive:  # gone meanwhile: it never hears "synced", so it cannot take over
                raise Unavailable("the standby went away before it held every job")
            self.set_role(sync=True)
            self.replication.required = True
            await f.wait(f.send(LogMessage("synced")), timeout=max(60.0, 10 * self.config.lease_s))
            self.replication.set_synced(f)
            log.info("the standby is in sync (%d job(s)); versions are acknowledged once it holds them",
                     len(f.jobs), extra=event("standby.in_sync", term=self.term))
            while f.alive:  # beats: the standby hears from an idle primary, and acks them
                seq = f.send(LogMessage("beat", term=self.term))
                await f.wait(seq, timeout=self.config.lease_s)
                await asyncio.sleep(self.config.lease_s / 4)
        except HpsError as exc:
            self.replication.detach(f, str(exc))
