"""What an unaligned payload costs: the passes a tier makes over received fp32 chunks (the
finiteness check of each arriving chunk, and ``base + chunk`` as a pulled delta is applied),
over chunks sliced from frames whose payload starts right after the header, as hps's frames
did before ``FrameHeader.pad`` (43 bytes in for this header; 33 for dataplane.py's), and from
frames as ``encode_frame`` writes them now (16-byte aligned), side by side in one process,
alternating.

    python benchmarks/frame_align.py

Writes benchmarks/results/frame_align.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import numpy as np
from _common import write

import ps.net.frames as frames
from ps.core.tensors import all_finite
from ps.net.proto import hps_pb2 as pb
from ps.net.wire import chunks_of


def _received(frame: bytes) -> np.ndarray:
    """The fp32 values of a frame's one chunk, as a tier slices them from a frame it received
    (a fresh bytes object, as gRPC hands one over)."""
    h, payload = frames.decode_frame(bytes(bytearray(frame)))
    return np.frombuffer(chunks_of(h.chunks, payload)[0].payload, np.float32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=100, help="frames of --elems fp32 values each")
    p.add_argument("--elems", type=int, default=1 << 20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    values = np.random.default_rng(0).standard_normal(args.elems, dtype=np.float32)
    header = pb.FrameHeader(chunks=pb.ChunkBatch(chunks=[pb.TensorChunk(
        key="layer.weight", dtype=pb.DTYPE_FLOAT32, shape=[args.elems], numel=args.elems,
        codec=pb.CODEC_FP32, nbytes=4 * args.elems)]))
    now = frames.encode_frame(header, memoryview(values).cast("B"))
    with mock.patch.object(frames, "_padding", lambda header, prefix: b""):  # as frames were before
        before = frames.encode_frame(header, memoryview(values).cast("B"))
    sets = {"unaligned": [_received(before) for _ in range(args.frames)],
            "aligned": [_received(now) for _ in range(args.frames)]}
    base, out = np.ones(args.elems, np.float32), np.empty(args.elems, np.float32)
    times: dict[str, dict[str, list[float]]] = {k: {"all_finite": [], "add": []} for k in sets}
    for rep in range(args.reps):
        for k in (["unaligned", "aligned"] if rep % 2 == 0 else ["aligned", "unaligned"]):
            t0 = time.perf_counter()
            for a in sets[k]:
                all_finite(a)
            times[k]["all_finite"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for a in sets[k]:
                np.add(base, a, out=out)
            times[k]["add"].append(time.perf_counter() - t0)
    mb = 4 * args.elems * args.frames / 1e6
    rows = {}
    for k, t in times.items():
        rows[k] = dict(aligned=bool(sets[k][0].flags.aligned), payload_offset=len(before if k == "unaligned" else now)
                       - 4 * args.elems, all_finite_s=statistics.median(t["all_finite"]),
                       add_s=statistics.median(t["add"]), runs=args.reps)
        print(f"{k:10s} payload {rows[k]['payload_offset']:2d} bytes in: all_finite "
              f"{rows[k]['all_finite_s'] * 1e3:7.1f} ms, base + chunk {rows[k]['add_s'] * 1e3:7.1f} ms "
              f"per {mb:.0f} MB (median of {args.reps})")
    u, a = rows["unaligned"], rows["aligned"]
    print(f"aligned vs unaligned: all_finite {u['all_finite_s'] / a['all_finite_s']:.1f}x faster, "
          f"base + chunk {u['add_s'] / a['add_s']:.1f}x faster")
    write("frame_align", dict(frames=args.frames, elems=args.elems, rows=rows), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
