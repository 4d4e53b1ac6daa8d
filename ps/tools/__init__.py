"""Processes and tools: the ``hps`` command, a local cluster launcher, ``hps status`` and
``hps job``, the WAN link emulator, and formatting helpers. May import any layer.
"""
