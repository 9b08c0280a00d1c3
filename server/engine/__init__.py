"""The round engine and everything it decides with: plain functions and state machines, no I/O, ``now`` given.

Imports run downward only: this package may use ``server.data``, ``server.algorithms`` and ``fedcore``, never the
drivers, ``server.mqtt`` or ``server.outputs``.
"""
