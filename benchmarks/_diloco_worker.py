"""One replica group of benchmarks/_diloco_peer.py: the demo model trained with torchft's DiLoCo,
its outer all-reduce (gloo) across the emulated WAN. Runs under torchft's interpreter
(HPS_PEER_PYTHON), not the project's.

    python benchmarks/_diloco_worker.py --lighthouse --min-replicas 4     # the Lighthouse
    python benchmarks/_diloco_worker.py --replica-id eu_0 --region eu --seed 0 --sync-every 50 \
        --steps 200 --batch 16 --lighthouse-addr 127.0.0.1:29510 --relay 127.0.0.1:40000

A worker is one torchft replica group (group world size 1): its own TCPStore and Manager,
DiLoCo over the whole model (one fragment) with AdamW inside (3e-3, 20 warm-up steps, as the
demo's Adam; torch's other defaults: betas 0.9/0.999, weight decay 0.01) and SGD outside (lr
0.7, momentum 0.9, Nesterov), fp32 pseudo-gradients in one bucketized all-reduce. Same model,
data and batches as benchmarks/_wan_worker.py (TinyLM seed 0, BatchSampler seed 1000 +
--seed). Prints one JSON line per step (absolute time, loss) and a final line (validation loss
on the final, synchronised parameters).

How its traffic crosses the WAN (the relay in _diloco_peer.py, one shared link per region): every
address this process reaches in another region (the Lighthouse, a peer's TCPStore, a peer's gloo
listener) is swapped for the relay's listener on the emulated path, asked of the relay's control
port ("ROUTE <region> <host:port>"); what this process listens on is declared first ("OWN").
The Manager is given the Lighthouse's route; the other swaps are done where torchft learns
those addresses: the store address in the quorum (``RoutedGloo.configure``) and gloo's
rendezvous records in that store (``RoutingStore`` rewrites a peer's sockaddr in its
"<device>/<rank>" record, on the end that connects). torchft itself is not changed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


class Relay:
    """The relay's control channel (local plumbing, not a WAN path)."""

    def __init__(self, address: str, region: str) -> None:
        self.address, self.region = address, region
        self._lock = threading.Lock()
        self._routes: dict[tuple[str, bool], str] = {}

    def _ask(self, line: str) -> str:
        host, port = self.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(line.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        reply = buf.decode().strip()
        if reply.startswith("ERR"):
            raise RuntimeError(f"relay refused {line!r}: {reply}")
        return reply

    def own(self, addr: str) -> None:
        self._ask(f"OWN {self.region} {addr}")

    def route(self, addr: str, low: bool = False) -> str:
        """Where to reach ``addr`` from this region (``low``: a listener on 127.0.0.0)."""
        with self._lock:
            if (addr, low) not in self._routes:
                self._routes[addr, low] = self._ask(f"ROUTE {self.region} {addr}" + (" low" if low else ""))
            return self._routes[addr, low]


_AF_INET, _AF_INET6 = 2, 10


def _rank_record(value: bytes) -> tuple[int, str] | None:
    """Where gloo's tcp rank record (size_t + hostname, size_t + the device's sockaddr_storage
    and seq, pair ids) keeps the device's address: (offset of the sockaddr, "ip:port"), or None
    if ``value`` is not one. Any other address family is an error: it would bypass the WAN."""
    if len(value) < 16:
        return None
    (hsz,) = struct.unpack_from("<Q", value, 0)
    if hsz > 1024 or 8 + hsz + 8 > len(value):
        return None
    off = 8 + hsz
    (asz,) = struct.unpack_from("<Q", value, off)
    off += 8
    if asz < 28 or off + asz > len(value) or (len(value) - off - asz) % 8:
        return None
    (family,) = struct.unpack_from("<H", value, off)
    (port,) = struct.unpack_from(">H", value, off + 2)
    if family == _AF_INET:
        return off, f"{socket.inet_ntop(socket.AF_INET, value[off + 4:off + 8])}:{port}"
    if family == _AF_INET6:
        return off, f"[{socket.inet_ntop(socket.AF_INET6, value[off + 8:off + 24])}]:{port}"
    raise RuntimeError(f"gloo rank record with address family {family}: cannot route it through the WAN")


def _gloo_key(value: bytes, off: int) -> tuple[bytes, int]:
    """What gloo's Device::isInitiator compares, for the sockaddr at ``off``: the address bytes,
    then sin_port as the host reads it (network byte order read as a little-endian int)."""
    (family,) = struct.unpack_from("<H", value, off)
    (port,) = struct.unpack_from("<H", value, off + 2)
    return (value[off + 4:off + 8] if family == _AF_INET else value[off + 8:off + 24]), port


class RoutingStore(dist.Store):
    """The PG's rendezvous store, with a peer's gloo address swapped for its relay path.

    Of the two ends of a gloo pair, the one whose own address compares higher connects (gloo's
    Device::isInitiator). The connecting end reads the relay's listener instead of the peer:
    one on 127.0.0.0, below every worker's 127.0.0.1, so it still decides to connect; the
    listening end reads the real address, so it still decides to wait."""

    def __init__(self, inner: dist.Store, relay: Relay) -> None:
        super().__init__()
        self.inner, self.relay = inner, relay
        self.own: tuple[bytes, int] | None = None

    def set(self, key, value):
        raw = value.encode() if isinstance(value, str) else bytes(value)
        rec = _rank_record(raw)
        if rec is not None:  # our own gloo listener: declare it before anyone can read it
            off, addr = rec
            if not addr.startswith("127.0.0.1:"):
                raise RuntimeError(f"gloo listens on {addr}; the WAN emulation needs it on 127.0.0.1")
            self.own = _gloo_key(raw, off)
            self.relay.own(addr)
        return self.inner.set(key, value)

    def get(self, key):
        raw = bytes(self.inner.get(key))
        rec = _rank_record(raw)
        if rec is None:
            return raw
        off, addr = rec
        if self.own is None:
            raise RuntimeError(f"read gloo record {key!r} before writing ours")
        if not self.own > _gloo_key(raw, off):
            return raw  # we listen: the peer connects to us (through its own route)
        routed = self.relay.route(addr, low=True)
        if routed == addr:
            return raw  # same region
        host, port = routed.rsplit(":", 1)
        out = bytearray(raw)
        out[off:off + 28] = bytes(28)  # an IPv4 sockaddr_in where the peer's was
        struct.pack_into("<H", out, off, _AF_INET)
        struct.pack_into(">H", out, off + 2, int(port))
        out[off + 4:off + 8] = socket.inet_aton(host)
        if not self.own > _gloo_key(bytes(out), off):
            raise RuntimeError(f"relay address {routed} would not keep us the connecting end of the pair")
        return bytes(out)

    def add(self, key, n):
        return self.inner.add(key, n)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def _routed_gloo(relay: Relay):
    from torchft.process_group import ProcessGroupGloo

    class RoutedGloo(ProcessGroupGloo):
        """torchft's ProcessGroupGloo; the quorum's store and the peers' gloo listeners are
        reached through the relay when they are in another region."""

        def configure(self, store_addr: str, *args, **kwargs) -> None:
            hostport, sep, prefix = store_addr.partition("/")
            super().configure(relay.route(hostport) + sep + prefix, *args, **kwargs)

        def _create_pg(self, store, rank: int, world_size: int):
            return super()._create_pg(RoutingStore(store, relay), rank, world_size)

    return RoutedGloo(timeout=timedelta(seconds=300))


@torch.no_grad()
def _val_loss(model, data, context: int, batches: int = 8, split: str = "val") -> float:
    from ps.demo.corpus import BatchSampler

    sampler = BatchSampler(data, context=context, batch_size=16, seed=1234, split=split)
    losses = [model(*sampler.next_batch())[1].item() for _ in range(batches)]
    return sum(losses) / len(losses)


def lighthouse(args) -> int:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_replicas)
    port = int(server.address().rsplit(":", 1)[1])
    print(f"lighthouse: serving 127.0.0.1:{port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait(args.max_s)
    server.shutdown()
    return 0


def train(args) -> int:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    from ps.demo.corpus import BatchSampler, load_corpus
    from ps.demo.model import ModelConfig, build_model

    torch.set_num_threads(1)
    relay = Relay(args.relay, args.region)
    cfg = ModelConfig()
    data = load_corpus()
    model = build_model(cfg, seed=0)
    sampler = BatchSampler(data, context=cfg.context, batch_size=args.batch, seed=1000 + args.seed)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: (s + 1) / args.warmup if s < args.warmup else 1.0)  # ps.core.optim.lr_at's ramp
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    relay.own(f"127.0.0.1:{store.port}")
    lighthouse_addr = "http://" + relay.route(args.lighthouse_addr)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(
        pg=_routed_gloo(relay), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.replicas, use_async_quorum=False, timeout=timedelta(seconds=300),
        quorum_timeout=timedelta(seconds=600), connect_timeout=timedelta(seconds=60), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse_addr,
        replica_id=args.replica_id, hostname="127.0.0.1",
        # Every replica builds TinyLM from seed 0: identical, nothing to copy at step 0.
        init_sync=False)
    # Timing only: how long each sync waits for its quorum (the Lighthouse round, and at the
    # first sync the process group's rendezvous) within the optimizer step that syncs.
    quorum_s = [0.0]
    start_quorum = manager.start_quorum

    def timed_start_quorum(*a, **kw):
        t = time.perf_counter()
        try:
            return start_quorum(*a, **kw)
        finally:
            quorum_s[0] += time.perf_counter() - t

    manager.start_quorum = timed_start_quorum
    syncs = []  # per sync: (seconds in the optimizer step, of which waiting for the quorum)
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, use_bucketization=True):
            _emit(event="start", worker=args.replica_id, t=time.time())
            for step in range(args.steps):
                x, y = sampler.next_batch()
                inner.zero_grad()
                loss = model(x, y)[1]
                loss.backward()
                quorum_s[0], t = 0.0, time.perf_counter()
                inner.step()  # DiLoCo's hook: every sync_every steps, the outer step (all-reduce)
                if (step + 1) % args.sync_every == 0:
                    syncs.append((time.perf_counter() - t, quorum_s[0]))
                warmup.step()
                _emit(event="step", worker=args.replica_id, step=step, t=time.time(), loss=loss.item(),
                      outer_steps=manager.current_step())
        synced = args.steps % args.sync_every == 0  # else the final parameters are each worker's own
        val = _val_loss(model, data, cfg.context)
        _emit(event="done", worker=args.replica_id, t=time.time(), outer_steps=manager.current_step(),
              val_loss=val if math.isfinite(val) else None, final_params_synced=synced,
              errored=str(manager.errored()) if manager.errored() else "", syncs=syncs)
    finally:
        manager.shutdown(wait=False)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lighthouse", action="store_true", help="run torchft's Lighthouse instead")
    p.add_argument("--min-replicas", type=int, default=4)
    p.add_argument("--max-s", type=float, default=3600.0, help="the Lighthouse stops after this at most")
    p.add_argument("--replica-id", default="eu_0")
    p.add_argument("--region", default="eu")
    p.add_argument("--replicas", type=int, default=4, help="min_replica_size of every quorum")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sync-every", type=int, default=50, help="H: inner steps per outer step")
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--lighthouse-addr", default="", help="HOST:PORT of the Lighthouse (real; routed here)")
    p.add_argument("--relay", default="", help="HOST:PORT of the relay's control port")
    args = p.parse_args()
    if args.lighthouse:
        return lighthouse(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
