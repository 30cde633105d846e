"""The Checkmate header as a scapy layer, bound to its UDP port.

After ``import checkmate.scapy_layer``, ``Ether(frame_bytes)`` dissects
Checkmate packets (including shadow copies, whose destination port was
rewritten but whose source port is still ``CHECKMATE_UDP_PORT``) and
``Ether()/IP()/UDP()/Checkmate(...)/payload`` builds them. The field layout
mirrors :mod:`checkmate.wire`, which stays the one codec used on the hot path;
a test checks that the two agree byte for byte.
"""

from __future__ import annotations

from scapy.fields import (
    ByteEnumField,
    ByteField,
    FlagsField,
    IntField,
    ShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from checkmate.wire import CHECKMATE_UDP_PORT, WIRE_VERSION, DType, MessageType

_MESSAGE_TYPES = {int(m): m.name for m in MessageType}
_DTYPES = {int(d): d.name for d in DType}
_FLAG_NAMES = ["REPLICATE", "RETRANSMIT", "LAST", "bit3", "bit4", "bit5", "bit6", "bit7"]


class Checkmate(Packet):
    """The 32-byte Checkmate header (docs/protocol.md)."""

    name = "Checkmate"
    fields_desc = [
        ByteField("version", WIRE_VERSION),
        ByteEnumField("msg_type", int(MessageType.DATA), _MESSAGE_TYPES),
        FlagsField("flags", 0, 8, _FLAG_NAMES),
        ByteEnumField("dtype", int(DType.FP32), _DTYPES),
        IntField("job_id", 0),
        IntField("iteration", 0),
        ShortField("bucket_id", 0),
        ShortField("sender_rank", 0),
        ShortField("shard_key", 0),
        ShortField("reserved", 0),
        IntField("element_offset", 0),
        IntField("element_count", 0),
        IntField("sequence", 0),
    ]

    def mysummary(self) -> str:
        return self.sprintf(
            "Checkmate %msg_type% job=%job_id% it=%iteration% bucket=%bucket_id% "
            "rank=%sender_rank% off=%element_offset% n=%element_count% flags=%flags%"
        )


bind_layers(UDP, Checkmate, dport=CHECKMATE_UDP_PORT)
bind_layers(UDP, Checkmate, sport=CHECKMATE_UDP_PORT)
