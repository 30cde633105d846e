"""Reading the Tofino-specific parts of a TNA P4Info (what p4c-barefoot writes by default).

For a TNA program the Tofino compiler lists counters not in ``P4Info.counters`` but as
``externs`` of type ``Counter`` whose ``info`` is a ``barefoot.Counter`` message (p4c's
``backends/tofino`` ``barefoot/p4info.proto``); ports and snapshots appear the same
way. The protobuf text parser cannot expand those ``Any`` values unless the message
types are known, so this module declares the few it needs (by field number, as the
compiler encodes them) in the default descriptor pool and reads counters out of them.

Compiled with ``--p4runtime-force-std-externs`` the compiler writes standard
``counters`` instead (and drops the ``pipe.`` prefix); :class:`checkmate.p4.p4info.P4InfoIndex`
reads both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from p4.config.v1 import p4info_pb2, p4types_pb2

logger = logging.getLogger(__name__)

COUNTER_EXTERN = "Counter"
"""``extern_type_name`` of TNA's indexed Counter in the compiler's P4Info."""

_FILE = "checkmate/barefoot_p4info_subset.proto"
_T = descriptor_pb2.FieldDescriptorProto


def _message(
    name: str,
    fields: list[tuple[str, int, int, str]],
    nested: list[descriptor_pb2.DescriptorProto] | None = None,
) -> descriptor_pb2.DescriptorProto:
    """fields: (name, number, FieldDescriptorProto.TYPE_*, type name or '' ); a '*' prefix means repeated."""
    message = descriptor_pb2.DescriptorProto(name=name)
    for fname, number, ftype, type_name in fields:
        repeated = fname.startswith("*")
        field = message.field.add(
            name=fname.lstrip("*"),
            number=number,
            type=ftype,
            label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL,
        )
        if type_name:
            field.type_name = type_name
    message.nested_type.extend(nested or [])
    return message


def _register() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindMessageTypeByName("barefoot.Counter")
        return  # already declared (by this module, or by the real generated code)
    except KeyError:
        pass
    spec = ".p4.config.v1.P4DataTypeSpec"
    proto = descriptor_pb2.FileDescriptorProto(
        name=_FILE, package="barefoot", syntax="proto3", dependency=[p4types_pb2.DESCRIPTOR.name]
    )
    proto.enum_type.add(name="Direction").value.extend(
        [
            descriptor_pb2.EnumValueDescriptorProto(name="DIRECTION_INGRESS", number=0),
            descriptor_pb2.EnumValueDescriptorProto(name="DIRECTION_EGRESS", number=1),
        ]
    )
    counter_unit = descriptor_pb2.EnumDescriptorProto(name="Unit")
    for number, unit in enumerate(("UNSPECIFIED", "BYTES", "PACKETS", "PACKETS_AND_BYTES")):
        counter_unit.value.add(name=unit, number=number)
    counter_spec = _message("CounterSpec", [("unit", 1, _T.TYPE_ENUM, ".barefoot.CounterSpec.Unit")])
    counter_spec.enum_type.append(counter_unit)
    proto.message_type.extend(
        [
            counter_spec,
            _message(
                "Counter",
                [("spec", 1, _T.TYPE_MESSAGE, ".barefoot.CounterSpec"), ("size", 2, _T.TYPE_INT64, "")],
            ),
            _message(
                "DirectCounter",
                [
                    ("spec", 1, _T.TYPE_MESSAGE, ".barefoot.CounterSpec"),
                    ("direct_table_id", 2, _T.TYPE_UINT32, ""),
                ],
            ),
            _message(
                "PortMetadata", [("key_name", 1, _T.TYPE_STRING, ""), ("type_spec", 2, _T.TYPE_MESSAGE, spec)]
            ),
            _message(
                "Snapshot",
                [
                    ("pipe", 1, _T.TYPE_STRING, ""),
                    ("direction", 2, _T.TYPE_ENUM, ".barefoot.Direction"),
                    ("*fields", 3, _T.TYPE_MESSAGE, ".barefoot.Snapshot.Field"),
                ],
                nested=[
                    _message(
                        "Field",
                        [
                            ("id", 1, _T.TYPE_UINT32, ""),
                            ("name", 2, _T.TYPE_STRING, ""),
                            ("bitwidth", 3, _T.TYPE_INT32, ""),
                        ],
                    )
                ],
            ),
        ]
    )
    pool.Add(proto)


_register()
_COUNTER_CLASS = message_factory.MessageFactory(descriptor_pool.Default()).GetPrototype(
    descriptor_pool.Default().FindMessageTypeByName("barefoot.Counter")
)


@dataclass(frozen=True)
class TofinoCounter:
    """One TNA Counter extern instance: its preamble and what ``barefoot.Counter`` says."""

    preamble: p4info_pb2.Preamble
    size: int
    unit: str
    """BYTES, PACKETS or PACKETS_AND_BYTES."""


def tofino_counters(info: p4info_pb2.P4Info) -> list[TofinoCounter]:
    """The indexed counters a TNA P4Info lists as Tofino ``Counter`` externs."""
    found = []
    for extern in info.externs:
        if extern.extern_type_name != COUNTER_EXTERN:
            continue
        for instance in extern.instances:
            counter = _COUNTER_CLASS()
            if not instance.info.Unpack(counter):
                raise ValueError(
                    f"counter {instance.preamble.name}: extern info is {instance.info.type_url}, "
                    "not barefoot.Counter"
                )
            unit = counter.DESCRIPTOR.fields_by_name["spec"].message_type.enum_types_by_name["Unit"]
            found.append(
                TofinoCounter(
                    instance.preamble, int(counter.size), unit.values_by_number[counter.spec.unit].name
                )
            )
    return found
