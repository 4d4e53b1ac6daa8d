"""What the tiers do with what passes through: job state, the shared tier behaviour, the root
(optimizer, durability: checkpoints and the write-ahead log) and the relays, and the metrics
they export. The async shell over ``ps.core``; talks to parents through ``ps.net``.
"""
