"""The embedded switch target: Checkmate's P4 pipeline in software.

BMv2 and p4c are not installable on every machine, so Checkmate ships its own
target for ``p4src/v1model/checkmate.p4``: the same tables, actions and
counters (by P4Info name) with v1model semantics (parser -> ingress ->
replication engine with egress_rid -> egress -> deparser), ports bound with
AF_PACKET, and a real P4Runtime gRPC server. ``checkmate-switch`` takes the
command line of ``simple_switch_grpc``. Controllers and packet tests cannot
tell the two apart.
"""
