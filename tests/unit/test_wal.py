"""The root's write-ahead log: durable records, exact replay, torn tails, segment cleanup."""

import numpy as np

from ps.wal import WalRecord, WriteAheadLog


def _rec(v: int, n: int = 5) -> WalRecord:
    return WalRecord(v, 2, v - 1, np.arange(n, dtype=np.float32) * v)


def test_records_replay_in_order_after_a_version(tmp_path):
    wal = WriteAheadLog(tmp_path)
    for v in range(1, 6):
        wal.append(_rec(v))
    wal.append(WalRecord(6, 0, 5, None))  # a round with no contributors
    wal.close()
    got = list(WriteAheadLog(tmp_path).records(after=3))
    assert [r.version for r in got] == [4, 5, 6]
    assert np.array_equal(got[0].grad, _rec(4).grad) and got[0].contributors == 2
    assert got[-1].grad is None


def test_a_torn_tail_ends_the_replay_there(tmp_path):
    wal = WriteAheadLog(tmp_path)
    for v in range(1, 4):
        wal.append(_rec(v))
    wal.close()
    (seg,) = list(tmp_path.glob("wal-*.log"))
    data = seg.read_bytes()
    seg.write_bytes(data[:-3])  # the crash cut the last record short
    assert [r.version for r in WriteAheadLog(tmp_path).records(after=0)] == [1, 2]
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # a corrupted record and everything after it is not replayed
    seg.write_bytes(bytes(flipped))
    assert [r.version for r in WriteAheadLog(tmp_path).records(after=0)] == [1]


def test_segments_covered_by_a_checkpoint_are_dropped(tmp_path):
    wal = WriteAheadLog(tmp_path)
    for v in (1, 2):
        wal.append(_rec(v))
    wal.rotate(3)  # checkpoint at version 2 is being written
    wal.append(_rec(3))
    wal.drop_upto(2)  # ... and is now durable
    assert [p.name for p in sorted(tmp_path.glob("wal-*.log"))] == ["wal-000000000003.log"]
    assert [r.version for r in wal.records(after=0)] == [3]
    wal.drop_upto(3)  # the current segment is never dropped
    assert len(list(tmp_path.glob("wal-*.log"))) == 1
