"""The parts of the embedded switch's P4Runtime server, one concern each.

``errors`` (canonical errors and bytestrings), ``index`` (the P4Info by id; match keys and
actions), ``sessions`` (StreamChannel sessions and arbitration), ``stream`` (the
StreamChannel RPC, PacketOut, PacketIn), ``config`` (forwarding pipeline configs),
``write`` and ``read``. :mod:`embedded_switch.p4runtime_server` assembles them and says
which lock each part takes.
"""
