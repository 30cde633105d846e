"""Checkmate's shared package: what every part of the system speaks.

``checkmate.wire`` is the gradient packet format (docs/protocol.md),
``checkmate.scapy_layer`` the same format as a scapy layer for dissection and
tests, ``checkmate.job`` the description of a training job that the
controller, host agents and shadows agree on, ``checkmate.control`` rank 0's
messages to its shadows (importable without torch), and ``checkmate.p4`` what
the controller, the embedded switch and the emulated network share about the P4
program. Data flows one way through the
other packages: hosts (workers) -> switch -> shadow -> checkpoint -> restore.
"""

__version__ = "0.1.0"
