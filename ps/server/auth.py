"""Bearer tokens: who may call what at this tier, checked before the tier sees the call.

>>> guard = Guard(admin_token="s3cret-admin")                   # a root without a checkpoint dir
>>> token = guard.mint("lm")                                    # what `hps job create` prints once
>>> guard.check_job(("s3cret-admin",), "lm"); guard.check_job((token,), "lm")   # both pass
>>> guard.check_admin((token,), "end jobs")
Traceback (most recent call last):
ps.core.errors.PermissionDenied: a job token cannot end jobs; present the admin token (HPS_ADMIN_TOKEN)
>>> guard.check_job(("guess",), "lm")
Traceback (most recent call last):
ps.core.errors.Unauthenticated: the token presented is not the token of job 'lm'; present its job token ...
>>> Guard(admin_token=None).check_admin((), "end jobs")          # no admin token: calls are open

Roles. The admin token may do everything: create, list and end jobs, read the status of every
job, and act in any job (a worker holding it creates its job and is handed the job's token,
which it then uses). A job's token may register, push, pull, resolve and leave in that job,
heartbeat for it, read that job's status only, and bring the initial values to that job once
an admin declared it; it cannot create or end jobs. Refusals are ``Unauthenticated`` (no
token, or none this tier knows) and ``PermissionDenied`` (a known token used for another job
or for an admin's call); the sentence says what to supply and never echoes a token.

Storage. Only SHA-256 hashes are kept, compared with ``hmac.compare_digest``. The root mints
a job's token (``secrets.token_urlsafe(32)``) when the admin's CreateJob makes the job, returns
it once in the reply, and keeps its hash in ``CHECKPOINT_DIR/job-tokens.json`` (written
atomically, mode 0600), so a restarted root still knows every job's token. A tier started
without an admin token (``--admin-token-file``) accepts every call as before and says so
loudly in its log and in ``hps status``: the same posture as ``--insecure``.

Trust model. Relays are cluster infrastructure: they check their own children's tokens against
the hash their parent sent when they registered for the job (``RegisterReply.token_sha256``:
b"" when the parent requires no token, ``ADMIN_ONLY`` for a job the root holds no token for),
and call their parent with their own identity. Until tiers present certificates (the mutual-TLS
half of issue 14) a parent cannot tell a relay from anyone else, so a relay proves its right
to a job by presenting the token of that job that its parent accepted when it registered (the
token of the first child that registered there; the parent checks it), and forwards the
admin's token for the admin calls it relays (create, list, end jobs), which the root decides.
Once certificates exist, ``relay_identity`` names the relay a verified certificate belongs to,
and a parent lets a verified relay act in any job without a job token (its children were
checked where they connected). A heartbeat naming no job is accepted without a token: it only
says a relay is alive, and readiness must not wait for a first job. The address it names is
recorded as a relay child (which ``hps status`` walks, with the admin token) only from a caller
this tier checked: a job's token, a verified relay certificate, or the admin's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path

from ps.core.errors import PermissionDenied, Unauthenticated, short
from ps.server.peers import peer_identity

__all__ = ["Guard", "guard_for", "digest", "relay_identity", "read_token_file", "write_secret", "TOKENS_FILE"]

TOKENS_FILE = "job-tokens.json"  # in the root's checkpoint directory: job -> SHA-256 of its token
# What a root with tokens sends its relays for a job it holds no token hash for: no token's
# SHA-256 (32 bytes) is equal to it, so below the root, as at it, only the admin acts on the job.
# (b"" would say "tokens are off": a relay then let anyone in.)
ADMIN_ONLY = b"admin-only"

log = logging.getLogger("hps.auth")

_JOB_TOKEN_HINT = "present its job token (token= or HPS_TOKEN, as `hps job create` printed it)"
_ADMIN_HINT = "present the admin token (HPS_ADMIN_TOKEN)"


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def read_token_file(path: str, what: str = "token") -> str:
    """A token from a file (its first line, stripped); ValueError names the file, never its content."""
    try:
        text = Path(path).read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path!r}: {exc.strerror}") from None
    if not text or not text[0].strip():
        raise ValueError(f"the {what} file {path!r} is empty")
    return text[0].strip()


def write_secret(path: str | Path, data: str | bytes, private: bool = True) -> None:
    """A token or key file, whole and (``private``) readable by its owner alone, whatever was
    there: written to a fresh file made 0600 (O_EXCL: a planted link or an older, looser file
    is never written through), synced, then renamed over ``path``. Opening ``path`` itself kept
    an existing file's mode (a re-used 0644 file then held the token for everyone)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def relay_identity(context) -> str | None:
    """The relay a call's verified client certificate belongs to, or None (no TLS, or a worker's
    or a foreign certificate). A certificate-verified relay acts for the jobs of its children
    without their tokens (the trust model above); ``ps.server.peers`` checks that it calls as
    the relay its certificate names."""
    ident = peer_identity(context)
    return ident.name if ident is not None and ident.relay else None


class Guard:
    """One tier's credentials: the admin token's hash and, at the root, every job's token hash
    (``store``: a file to persist them in); a relay asks ``hashes_from`` (its parent link's
    ``token_hashes``) instead."""

    def __init__(self, admin_token: str | None, store: str | Path | None = None,
                 hashes_from: dict[str, bytes] | None = None) -> None:
        self._admin = digest(admin_token) if admin_token else None
        self._store = Path(store) if store else None
        self._root = hashes_from is None
        self._hashes: dict[str, bytes] = {} if hashes_from is None else hashes_from
        if self._store is not None and self._store.exists():
            saved = json.loads(self._store.read_text())
            self._hashes.update({job: bytes.fromhex(h) for job, h in saved.items()})

    @property
    def enabled(self) -> bool:
        """False: no admin token configured; every call is accepted (and the tier says so)."""
        return self._admin is not None

    # -- job tokens at the root -----------------------------------------------------------------
    def has_token(self, job: str) -> bool:
        return bool(self._hashes.get(job))

    def hash_of(self, job: str) -> bytes:
        """The job's token hash, as a relay child learns it: b"" when tokens are off (the job is
        open), ``ADMIN_ONLY`` for a job the root holds no token for (restored from before an
        admin token was set, or resharded from shards whose tokens differed): only the admin's
        token acts on it, below as at the root."""
        if not self.enabled:
            return b""
        h = self._hashes.get(job)
        if h:
            return h
        return ADMIN_ONLY if self._root else b""

    def mint(self, job: str) -> str:
        """A new token for ``job``: its hash is kept (and persisted) here, the token returned once."""
        token, h = self.new_token()
        self.set_hash(job, h)
        return token

    @staticmethod
    def new_token() -> tuple[str, bytes]:
        """A fresh token and its hash, kept nowhere yet (a root keeps the hash and sends it to its
        standby before the token is handed out: ``Root.keep_token``)."""
        token = secrets.token_urlsafe(32)
        return token, digest(token)

    def set_hash(self, job: str, h: bytes) -> None:
        """Keep (and persist) ``job``'s token hash; b"": forget it. A standby root keeps what its
        primary sends, so a takeover knows every job's token."""
        if h:
            if self._hashes.get(job) == h:
                return
            self._hashes[job] = h
        elif self._hashes.pop(job, None) is None:
            return
        self._save()

    def hashes(self) -> dict[str, bytes]:
        return dict(self._hashes)

    def replace(self, hashes: dict[str, bytes]) -> None:
        """Every job's token hash at once (a standby starting to follow its primary)."""
        if hashes != self._hashes:
            self._hashes.clear()
            self._hashes.update(hashes)
            self._save()

    def forget(self, job: str) -> None:
        if self._root:
            self.set_hash(job, b"")

    def _save(self) -> None:
        if self._store is None:
            return
        self._store.parent.mkdir(parents=True, exist_ok=True)
        write_secret(self._store, json.dumps({job: h.hex() for job, h in self._hashes.items()}))

    # -- checks ---------------------------------------------------------------------------------
    # Each check hashes the tokens presented once (``_digests``), then compares hashes: a call
    # presenting hundreds of tokens and naming a thousand jobs (a heartbeat) cost a SHA-256 of
    # every token for every job, twice -- ~10^5 hashes on the event loop per call (review).
    # Comparing hashes, not tokens, reveals nothing usable about a token, so a job is found by
    # its hash in a dict.
    @staticmethod
    def _digests(tokens: tuple[str, ...]) -> tuple[bytes, ...]:
        return tuple(digest(t) for t in dict.fromkeys(tokens))

    def is_admin(self, tokens: tuple[str, ...]) -> bool:
        """Whether ``tokens`` hold the admin token (False when this tier has none)."""
        return self._is_admin(self._digests(tokens))

    def _is_admin(self, ds: tuple[bytes, ...]) -> bool:
        return any(hmac.compare_digest(d, self._admin) for d in ds) if self._admin else False

    def _jobs_of(self, ds: tuple[bytes, ...]) -> set[str]:
        """The jobs whose token's hash is among ``ds``."""
        by_hash: dict[bytes, list[str]] = {}
        for job, h in self._hashes.items():
            if h and h != ADMIN_ONLY:
                by_hash.setdefault(h, []).append(job)
        return {job for d in ds for job in by_hash.get(d, ())}

    def check_admin(self, tokens: tuple[str, ...], what: str) -> None:
        ds = self._digests(tokens)
        if not self.enabled or self._is_admin(ds):
            return
        if not tokens:
            raise Unauthenticated(f"this tier needs the admin token to {what}; {_ADMIN_HINT}")
        if self._jobs_of(ds):
            raise PermissionDenied(f"a job token cannot {what}; {_ADMIN_HINT}")
        raise Unauthenticated(f"the token presented is not the admin token; {_ADMIN_HINT} to {what}")

    def check_job(self, tokens: tuple[str, ...], job: str, relay: str | None = None) -> None:
        """Pass if ``tokens`` hold ``job``'s token or the admin's (or a verified relay calls)."""
        if not self.enabled or relay is not None:
            return
        self._check_job(tokens, self._digests(tokens), job)

    def check_known(self, tokens: tuple[str, ...], jobs: list[str], relay: str | None = None) -> list[str]:
        """``check_job`` of every job of ``jobs`` this tier can check (``knows``), each once, the
        tokens hashed once; the jobs checked (a heartbeat's)."""
        known = [j for j in dict.fromkeys(jobs) if self.knows(j)]
        if self.enabled and relay is None and known:
            ds = self._digests(tokens)
            for job in known:
                self._check_job(tokens, ds, job)
        return known

    def _check_job(self, tokens: tuple[str, ...], ds: tuple[bytes, ...], job: str) -> None:
        if self._is_admin(ds):
            return
        h = self._hashes.get(job)
        if h is None and not self._root:
            # A relay that holds no such job: the tier registers upward presenting these tokens,
            # where the parent checks them, or answers NotMember (register first).
            return
        if h is not None and not h:
            return  # a relay whose parent requires no tokens for this job: the job is open
        if h == ADMIN_ONLY:
            raise (PermissionDenied if tokens else Unauthenticated)(
                f"job {short(job)} has no job token (it was restored or resharded without one): only the admin "
                f"token acts on it; {_ADMIN_HINT}")
        if not tokens:
            raise Unauthenticated(f"job {short(job)} needs its token; {_JOB_TOKEN_HINT}")
        if h is not None and any(hmac.compare_digest(d, h) for d in ds):
            return
        if self._jobs_of(ds):
            raise PermissionDenied(f"the token presented belongs to another job, not {short(job)}; "
                                   f"{_JOB_TOKEN_HINT}")
        raise Unauthenticated(f"the token presented is not the token of job {short(job)}; {_JOB_TOKEN_HINT}")

    def admin_only(self, job: str) -> bool:
        """Whether only the admin's token acts on ``job`` here (its root held no token for it)."""
        return self._hashes.get(job) == ADMIN_ONLY

    def knows(self, job: str) -> bool:
        """Whether this tier can check ``job``'s tokens itself (a relay: once it registered)."""
        return job in self._hashes

    def status_scope(self, tokens: tuple[str, ...]) -> set[str] | None:
        """The jobs whose status the caller may read (None: all of them, and the tree)."""
        ds = self._digests(tokens)
        if not self.enabled or self._is_admin(ds):
            return None
        mine = self._jobs_of(ds)
        if not mine:
            if tokens:
                raise Unauthenticated("the token presented is neither the admin token nor a job's; "
                                      f"{_ADMIN_HINT}, or a job's token for that job's status")
            raise Unauthenticated(f"this tier's status needs a token; {_ADMIN_HINT}, or a job's token "
                                  "for that job's status")
        return mine


def guard_for(config, tier) -> Guard:
    """The guard of a tier started with ``config`` (a ServerConfig); logs loudly when it is open."""
    admin = read_token_file(config.admin_token_file, "admin token") if config.admin_token_file else None
    if config.role == "global":
        store = Path(config.checkpoint_dir) / TOKENS_FILE if config.checkpoint_dir else None
        guard = Guard(admin, store=store)
        tier.tokens = guard  # the root sends job tokens' hashes to its standby (ps.tiers.root)
    else:
        link = tier.parent_link()
        guard = Guard(admin, hashes_from=link.token_hashes)
        link.admin_token = admin  # shown on its heartbeats: the parent lists it for `hps status`
    if not guard.enabled:
        log.warning("%s %s: NO ADMIN TOKEN (--admin-token-file): this tier accepts every call from anyone "
                    "who can reach it, without a token; run it so only on a trusted network",
                    config.role, config.display_name)
    return guard
