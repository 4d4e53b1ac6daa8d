"""Structured logs: one JSON object per line (``hps serve --log-format json``), for a pipeline.

>>> import io, json, logging
>>> out = io.StringIO()
>>> logger = logging.getLogger("hps.example")
>>> handler = logging.StreamHandler(out)
>>> handler.setFormatter(JsonFormatter(process_fields("zone", "eu-a")))
>>> logger.addHandler(handler); logger.propagate = False
>>> logger.warning("job %s dropped %s", "lm", ["w1"], extra=event("member.expired", job="lm", members=["w1"]))
>>> line = json.loads(out.getvalue())
>>> line["message"], line["event"], line["tier"], line["zone"], line["job"], line["members"], line["level"]
("job lm dropped ['w1']", 'member.expired', 'zone', 'eu-a', 'lm', ['w1'], 'WARNING')
>>> sorted(line)
['event', 'job', 'level', 'logger', 'members', 'message', 'name', 'tier', 'ts', 'zone']

Every line has ``ts`` (UTC, ISO 8601), ``level``, ``logger`` and ``message``; the process's
``tier`` (its role: global, regional, zone), ``region`` or ``zone`` and ``name`` (the same
labels as its metrics); and whatever the call passed with ``extra=event(...)``: ``event`` (a
stable dotted name a pipeline can match on, listed in ``EVENTS``), ``job``, ``version`` and
the event's own fields. Lines without an event are plain log lines. The text format (the
default) shows the message only.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["EVENTS", "JsonFormatter", "event", "process_fields", "use_json"]

# The events the tiers, the launcher and the worker log, so a pipeline can alert on them.
EVENTS = frozenset({
    "tier.started", "tier.stopping", "tier.stopped", "tier.insecure", "tier.stalled",
    "job.created", "job.declared", "job.ended", "job.restored", "job.damaged",
    "member.joined", "member.left", "member.expired", "member.replaced",
    "round.restarted", "round.refused", "push.forgotten",
    "checkpoint.written", "checkpoint.failed", "wal.write_failed",
    "parent.lost", "parent.regained", "parent.restarted", "parent.switched", "parent.returned",
    "parent.bad_snapshot",
    "launch.tier_died", "launch.tier_restarted", "launch.tier_failed",
    "worker.retrying", "worker.recovered", "worker.gave_up", "worker.switched", "worker.returned",
    "training.loss_rising",
    "rank.assigned", "rank.released", "data.declared", "lease.expired",
    "root.primary", "root.promoted", "root.deposed", "standby.following", "standby.synced", "standby.in_sync",
    "standby.kept",
    "outer.started", "outer.sync_failed", "outer.sync_postponed", "outer.sync_unsettled", "outer.steps_lost",
    "outer.dropped", "outer.steps_per_sync", "outer.restarted",
})

# What every LogRecord has; anything else on a record came with ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def event(name: str, **fields: Any) -> dict[str, Any]:
    """The ``extra=`` of a log call that reports event ``name`` (one of ``EVENTS``)."""
    if name not in EVENTS:
        raise ValueError(f"log event {name!r} is not one of EVENTS")
    return {"event": name, **fields}


def process_fields(role: str, name: str) -> dict[str, str]:
    """The fields identifying a tier process: as its metrics' labels (``tier``, ``region`` for
    a regional master, ``zone`` for a zone replica) and its ``name``."""
    fields = {"tier": role, "name": name}
    if role in ("regional", "zone") and name:
        fields["region" if role == "regional" else "zone"] = name
    return fields


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line (newlines in messages are escaped)."""

    def __init__(self, fields: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            **self.fields}
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def use_json(fields: dict[str, Any]) -> None:
    """Switch every handler of the root logger to ``JsonFormatter(fields)`` (``hps serve``)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig()
    for h in root.handlers:
        h.setFormatter(JsonFormatter(fields))
