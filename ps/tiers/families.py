"""What a tier exports, as Prometheus metric families rendered from one status snapshot (pure:
no registry, no server, no event loop, so every family is unit-tested from a dict).

>>> from ps.core.types import TierStatus
>>> status = TierStatus(role="zone", name="eu-a", server_epoch=9, parent="eu:7000",
...                     parent_reachable=True, ready=True, uptime_s=5.0, jobs=())
>>> link = dict(reachable=True, errors=0, reconnects=0)          # the upstream link's watch
>>> fams = families(dict(status=status, link=link, durability=None), {"tier": "zone", "zone": "eu-a"})
>>> [(s.name, s.labels, s.value) for f in fams for s in f.samples if s.name == "hps_upstream_reachable"]
[('hps_upstream_reachable', {'tier': 'zone', 'zone': 'eu-a'}, 1)]

``ps.tiers.metrics`` takes the snapshot on the tier's event loop when Prometheus scrapes and
serves these; the names, units and the bounded label set are described there.
"""

from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    SummaryMetricFamily,
)

from ps.tiers.wal import FSYNC_BUCKETS

__all__ = ["families", "durability_families"]


def families(snap: dict, labels: dict[str, str]) -> list:
    """Every scrape-time family from one snapshot (pure: unit-testable without a server)."""
    s = snap["status"]
    base_names, base = list(labels), list(labels.values())
    jl = [*base_names, "job"]
    is_relay = snap["link"] is not None
    ages = snap.get("version_age") or {}

    def gauge(name, doc, names=jl):
        return GaugeMetricFamily(name, doc, labels=names)

    def counter(name, doc, names=jl):
        return CounterMetricFamily(name, doc, labels=names)

    info = InfoMetricFamily("hps_tier", "This tier: its name and the address of the parent it uses",
                            labels=base_names)
    info.add_metric(base, {"name": s.name, "parent": s.parent or ""})
    jobs = gauge("hps_jobs", "Training jobs this tier holds", base_names)
    jobs.add_metric(base, len(s.jobs))
    children = gauge("hps_children", "Relay children that announced themselves by heartbeat "
                                     "within the member timeout", base_names)
    children.add_metric(base, len(s.children))
    ready = gauge("hps_ready", "1 once this tier has synced with its parent (the health "
                               "service's readiness answer), else 0", base_names)
    ready.add_metric(base, 1 if s.ready else 0)
    out = [info, jobs, children, ready]

    version = gauge("hps_version", "Published-view version this tier holds")
    lag_v = gauge("hps_replica_lag_versions", "Versions this replica trails its parent by, as far "
                                              "as it knows (0 at the root)")
    lag_s = gauge("hps_replica_lag_seconds", "Seconds since this replica last confirmed it held its "
                                             "parent's latest version, while behind or cut off (0 in sync)")
    members = gauge("hps_members", "Live members of the job at this tier (workers or child relays)")
    workers = gauge("hps_workers", "Live workers attached to this tier in the job (members that are "
                                   "workers, not relays)")
    lost = gauge("hps_members_lost", "Members dropped after the member timeout that have not come "
                                     "back (died or cut off; finished members leave and are not "
                                     "counted), by role: worker | relay", [*jl, "role"])
    age = gauge("hps_version_age_seconds", "Seconds since this tier's version of the job last "
                                           "changed (as seen at scrapes): at the root, time "
                                           "without a new version")
    open_round = gauge("hps_round_pushes", "Pushes collected in the open BSP round or window")
    pushes = counter("hps_pushes_total", "Pushes accepted from children (aggregated pushes from relays)")
    push_bytes = counter("hps_push_bytes_total", "Tensor payload bytes of pushes: received from "
                                                 "children (edge=children), sent to the parent "
                                                 "(edge=parent)", [*jl, "edge"])
    pull_bytes = counter("hps_pull_bytes_total", "Tensor payload bytes of pulls: served to children "
                                                 "(edge=children), received from the parent "
                                                 "(edge=parent)", [*jl, "edge"])
    # Before compression: what the same tensors decode to (float32). Only the children edge:
    # a tier's parent edge is its parent's children edge, where the same pushes and pulls are
    # counted. A push carries the job's whole gradient and a delta or snapshot its whole
    # vector, so this is the count times the job's size (a relay's rare 0-contributor push,
    # which only carries a clock floor, counts as one too).
    push_raw = counter("hps_push_decoded_bytes_total", "Bytes the pushes received from children "
                                                       "decode to (float32, before compression)",
                       [*jl, "edge"])
    pull_raw = counter("hps_pull_decoded_bytes_total", "Bytes the deltas and snapshots served to "
                                                       "children decode to (float32, before "
                                                       "compression)", [*jl, "edge"])
    hits = counter("hps_delta_log_hits_total", "Versions served to children as deltas from the delta log")
    fallbacks = counter("hps_snapshot_fallbacks_total", "Pulls answered with a full snapshot (the caller "
                                                        "had no view, fell behind the delta log, or "
                                                        "held another root epoch)")
    rounds = counter("hps_rounds_total", "BSP rounds (or ssp/async windows) closed at this tier")
    aborted = counter("hps_aborted_rounds_total", "Rounds aborted before they were applied (a tier "
                                                  "or the root restarted)")
    restarted = counter("hps_restarted_rounds_total", "Open rounds restarted because a member left, "
                                                      "timed out or was replaced with its push in them "
                                                      "(their other pushers resend)")
    refused = counter("hps_refused_rounds_total", "Closed rounds refused whole (a non-finite sum, a "
                                                  "failed durable write, a refusal from the parent)")
    dups = counter("hps_duplicate_pushes_total", "Retried pushes answered with the recorded "
                                                 "acknowledgement (applied once)")
    resolved = counter("hps_resolved_pushes_total", "Retries that could not be placed and whose outcome "
                                                    "was asked up the tree before answering")
    departures = counter("hps_member_departures_total", "Members that left the job at this tier, by "
                         "reason: left (said goodbye), expired (silent past the member timeout: a "
                         "dead or cut-off child, its round shrinks), replaced (restarted as a new "
                         "incarnation)", [*jl, "reason"])
    wait = SummaryMetricFamily("hps_barrier_wait_seconds", "Time accepted pushes waited for their "
                                                           "round (BSP barrier) or window to be "
                                                           "applied", labels=jl)
    bound = gauge("hps_job_staleness_bound", "The ssp job's staleness bound s, in worker clocks "
                                             "(steps); ssp jobs only")
    # What the workers below report with their pushes (loss, step time): summaries, so a mean
    # over any window is rate(_sum) / rate(_count); at the root they cover the whole job.
    w_loss = SummaryMetricFamily("hps_worker_loss", "Training losses the workers below this tier "
                                 "reported with their pushes", labels=jl)
    w_step = SummaryMetricFamily("hps_worker_step_seconds", "Wall time of the workers' steps "
                                 "(compute, push and pull) as they reported them", labels=jl)
    out += [version, lag_v, lag_s, members, workers, lost, age, open_round, pushes, push_bytes, pull_bytes, push_raw,
            pull_raw, hits, fallbacks, rounds, aborted, restarted, refused, dups, resolved, departures,
            wait, bound, w_loss, w_step]
    # Outer jobs at the tier running a region's inner loop (ps.tiers.outer): the WAN side.
    o_version = gauge("hps_outer_version", "Outer version the region's parameters were last rebased on")
    o_syncs = counter("hps_outer_syncs_total", "Pseudo-gradients of this region the root applied "
                                               "(one fragment each)")
    o_failed = counter("hps_outer_sync_failures_total", "Syncs that failed (their inner steps go with "
                                                        "the next sync)")
    o_latency = SummaryMetricFamily("hps_outer_sync_seconds", "From sending a pseudo-gradient to "
                                    "holding the outer version that applied it", labels=jl)
    o_bytes = counter("hps_outer_wan_bytes_total", "Payload bytes across the WAN edge: pseudo-gradients "
                      "sent (direction=up), outer versions pulled (direction=down)", [*jl, "direction"])
    o_norm = gauge("hps_outer_pseudo_gradient_norm", "L2 norm of the last pseudo-gradient, per worker")
    o_since = gauge("hps_outer_inner_steps_since_sync", "Inner steps not yet in any pseudo-gradient")
    o_lost = counter("hps_outer_inner_steps_lost_total", "Inner steps lost to restarts of this tier or "
                                                         "dropped when every member left (never silent)")
    o_period = gauge("hps_outer_inner_steps_per_sync", "Inner steps between this region's syncs now "
                     "(H / F; with dynamic steps scaled by the region's speed against the fastest region's)")
    o_postponed = counter("hps_outer_syncs_postponed_total", "Syncs that had not landed within the job's "
                          "sync_wait_s (the root or the WAN down): the region trained on without them")
    o_unsettled = counter("hps_outer_syncs_unsettled_total", "Syncs given up on after the round timeout "
                          "with no answer, then asked about until the root knew whether it applied them "
                          "(without sync_wait_s or overlap the region waits meanwhile)")
    outer_fams = [o_version, o_syncs, o_failed, o_latency, o_bytes, o_norm, o_since, o_lost, o_period, o_postponed,
                  o_unsettled]
    staleness = stale_max = None
    if s.role == "global":
        # A summary, not a histogram: the root keeps only the count, sum and maximum.
        staleness = SummaryMetricFamily("hps_update_staleness_versions", "Versions between the view "
                                        "an update was computed on and the one it was applied to",
                                        labels=jl)
        stale_max = gauge("hps_update_staleness_max_versions", "The largest staleness observed "
                                                               "since the root started")
        doubled = counter("hps_double_applied_pushes_total", "Worker pushes the root applied in a second "
                          "version (exactly-once broken: must stay 0; logged CRITICAL)")
        not_durable = counter("hps_durable_write_failures_total", "Versions refused because their "
                              "write-ahead-log record could not be made durable (disk full, I/O error)")
        ckpt_failed = counter("hps_checkpoint_failures_total", "Checkpoints that failed to write (the log "
                              "still covers them)")
        # In worker clocks (steps), the unit of an ssp bound: how far the newest clock in an
        # update ran ahead of the clock floor of the view it was applied to.
        clocks = SummaryMetricFamily("hps_update_staleness_clocks", "Worker clocks between the newest "
                                     "clock in an update and the clock floor of the view it was "
                                     "applied to (an ssp(s) job keeps it <= s)", labels=jl)
        clocks_max = gauge("hps_update_staleness_max_clocks", "The largest clock staleness observed "
                                                              "since the root started")
        over = counter("hps_updates_over_bound_total", "Updates of ssp jobs whose clock staleness "
                       "exceeded the job's bound s (invariant 3 broken: must stay 0)")
        out += [staleness, stale_max, doubled, not_durable, ckpt_failed, clocks, clocks_max, over]
    if is_relay:
        out += outer_fams

    for j in s.jobs:
        lv, st = [*base, j.name], j.stats
        version.add_metric(lv, j.version)
        lag_v.add_metric(lv, j.lag_versions)
        lag_s.add_metric(lv, j.lag_s)
        members.add_metric(lv, len(j.members))
        workers.add_metric(lv, sum(1 for m in j.members if m.role == "worker"))
        for role in ("worker", "relay"):
            lost.add_metric([*lv, role], sum(1 for m in j.lost if (m.role == "worker") == (role == "worker")))
            # (a relay child's role is its tier's, regional or zone: one bounded "relay" here)
        if j.name in ages:
            age.add_metric(lv, ages[j.name])
        open_round.add_metric(lv, j.round_pushed)
        pushes.add_metric(lv, st.pushes)
        push_bytes.add_metric([*lv, "children"], st.bytes_pushed_in)
        pull_bytes.add_metric([*lv, "children"], st.bytes_pulled_out)
        size = 4 * j.parameters
        push_raw.add_metric([*lv, "children"], st.pushes * size)
        pull_raw.add_metric([*lv, "children"], (st.deltas_served + st.snapshots_served) * size)
        if j.mode == "ssp":
            bound.add_metric(lv, j.staleness)
        if is_relay:
            push_bytes.add_metric([*lv, "parent"], st.bytes_pushed_up)
            pull_bytes.add_metric([*lv, "parent"], st.bytes_pulled_in)
        hits.add_metric(lv, st.deltas_served)
        fallbacks.add_metric(lv, st.snapshots_served)
        rounds.add_metric(lv, st.rounds)
        aborted.add_metric(lv, st.aborted_rounds)
        restarted.add_metric(lv, st.restarted_rounds)
        refused.add_metric(lv, st.refused_rounds)
        dups.add_metric(lv, st.duplicates)
        resolved.add_metric(lv, st.resolved)
        for reason in ("left", "expired", "replaced"):
            departures.add_metric([*lv, reason], getattr(st, f"members_{reason}"))
        wait.add_metric(lv, count_value=st.pushes, sum_value=st.round_wait_ms_sum / 1000.0)
        w_loss.add_metric(lv, count_value=st.loss_count, sum_value=st.loss_sum)
        w_step.add_metric(lv, count_value=st.loss_count, sum_value=st.step_seconds_sum)
        if j.inner_loop:
            o_version.add_metric(lv, st.outer_version)
            o_syncs.add_metric(lv, st.outer_syncs)
            o_failed.add_metric(lv, st.outer_sync_failures)
            o_latency.add_metric(lv, count_value=st.outer_syncs, sum_value=st.outer_sync_seconds_sum)
            o_bytes.add_metric([*lv, "up"], st.outer_bytes_up)
            o_bytes.add_metric([*lv, "down"], st.outer_bytes_down)
            o_norm.add_metric(lv, st.pseudo_grad_norm)
            o_since.add_metric(lv, st.inner_steps_since_sync)
            o_lost.add_metric(lv, st.inner_steps_lost)
            o_period.add_metric(lv, st.inner_steps_per_sync)
            o_postponed.add_metric(lv, st.outer_syncs_postponed)
            o_unsettled.add_metric(lv, st.outer_syncs_unsettled)
        if staleness is not None:
            staleness.add_metric(lv, count_value=st.staleness_count, sum_value=st.staleness_sum)
            stale_max.add_metric(lv, st.staleness_max)
            doubled.add_metric(lv, st.double_applied)
            not_durable.add_metric(lv, st.durable_failures)
            ckpt_failed.add_metric(lv, st.checkpoint_failures)
            clocks.add_metric(lv, count_value=st.clock_staleness_count, sum_value=st.clock_staleness_sum)
            clocks_max.add_metric(lv, st.clock_staleness_max)
            over.add_metric(lv, st.over_bound)

    if is_relay:
        link = snap["link"]
        reach = gauge("hps_upstream_reachable", "1 if the last call to the parent succeeded, else 0",
                      base_names)
        reach.add_metric(base, 1 if link["reachable"] else 0)
        errors = counter("hps_upstream_errors_total", "Calls to the parent that failed as unavailable "
                                                      "or timed out", base_names)
        errors.add_metric(base, link["errors"])
        again = counter("hps_upstream_reconnects_total", "Times the link to the parent answered again "
                                                         "after failing", base_names)
        again.add_metric(base, link["reconnects"])
        # Alternate parents (issue 15): which one is in use, and every move between them.
        switched = counter("hps_parent_switches_total", "Times this relay moved to another of its "
                                                        "parents (--parent A,B) after losing one", base_names)
        switched.add_metric(base, s.parent_switches)
        which = gauge("hps_parent_index", "Which of its configured parents this relay uses: 0 the first "
                                          "(preferred), 1 the next, ...", base_names)
        which.add_metric(base, s.parents.index(s.parent) if s.parent in s.parents else 0)
        cut = gauge("hps_parent_cut_off_seconds", "Seconds no parent of this relay has answered "
                                                  "(0 while one does)", base_names)
        cut.add_metric(base, s.parent_cut_off_s)
        out += [reach, errors, again, switched, which, cut]
    if snap.get("durability") is not None:
        out += durability_families(snap["durability"], base_names, base)
    if snap.get("standby") is not None:  # one root of a hot-standby pair (issue 15)
        sb = snap["standby"]
        primary = gauge("hps_root_primary", "1 if this root of a hot-standby pair is the primary (accepts "
                                            "pushes), 0 if it is the standby or fenced", base_names)
        primary.add_metric(base, 1 if sb["state"] == "primary" else 0)
        term = gauge("hps_root_term", "This root's term: it rises by one at every takeover", base_names)
        term.add_metric(base, sb["term"])
        out += [primary, term]
        if sb["state"] == "primary":
            in_sync = gauge("hps_root_standby_in_sync", "1 if this primary root's standby holds its whole "
                                                        "state and acknowledges every version, else 0 (a primary "
                                                        "whose standby was once in sync then refuses pushes)",
                            base_names)
            in_sync.add_metric(base, 1 if sb["in_sync"] else 0)
            out.append(in_sync)
    return out


def durability_families(d: dict, base_names: list[str], base: list[str]) -> list:
    """The root's durability: when each job's last checkpoint was written and how long it took,
    the write-ahead log's fsync latency, and the checkpoint volume's space."""
    jl = [*base_names, "job"]
    when = GaugeMetricFamily("hps_checkpoint_last_success_timestamp_seconds", "Unix time the job's "
                             "last checkpoint was written (absent until the first one)", labels=jl)
    took = GaugeMetricFamily("hps_checkpoint_last_duration_seconds", "How long the job's last "
                             "checkpoint took to write (off the event loop)", labels=jl)
    fsync = HistogramMetricFamily("hps_wal_fsync_seconds", "Write-ahead-log fsyncs (every "
                                  "acknowledged version waits for one)", labels=jl)
    appended = CounterMetricFamily("hps_wal_bytes_written_total", "Bytes appended to the job's "
                                   "write-ahead log", labels=jl)
    for name, j in sorted(d["jobs"].items()):
        lv = [*base, name]
        if j["checkpoint"] is not None:
            t, secs, _version = j["checkpoint"]
            when.add_metric(lv, t)
            took.add_metric(lv, secs)
        w = j["wal"]
        if w is not None:
            cumulative, total = [], 0
            for le, n in zip(FSYNC_BUCKETS, w.fsync_buckets):
                total += n
                cumulative.append((repr(le), total))
            cumulative.append(("+Inf", w.appends))
            fsync.add_metric(lv, cumulative, sum_value=w.total_fsync_s)
            appended.add_metric(lv, w.bytes_written)
    out = [when, took, fsync, appended]
    if d["volume"] is not None:
        used = GaugeMetricFamily("hps_checkpoint_volume_used_bytes", "Bytes used on the volume "
                                 "that holds the checkpoints and write-ahead logs", labels=base_names)
        free = GaugeMetricFamily("hps_checkpoint_volume_free_bytes", "Bytes this process may still "
                                 "write on that volume", labels=base_names)
        used.add_metric(base, d["volume"].used)
        free.add_metric(base, d["volume"].free)
        out += [used, free]
    return out
