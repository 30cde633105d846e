"""The embedded switch target: Checkmate's P4 pipeline in software.

BMv2 and p4c are not installable on every machine, so Checkmate ships its own
target for ``p4src/v1model/checkmate.p4``: the same tables, actions and
counters (by P4Info name) with v1model semantics (parser -> ingress ->
replication engine with egress_rid -> egress -> deparser), ports bound with
AF_PACKET, and a real P4Runtime gRPC server. ``checkmate-switch`` takes the
command line of ``simple_switch_grpc``. Controllers and packet tests cannot
tell the two apart.

``program`` checks that a pushed P4Info is the Checkmate program and builds the empty
``state`` (tables, multicast groups, counters); ``pipeline`` runs frames through it;
``ports`` binds interfaces; ``p4runtime_server`` serves P4Runtime, assembled from
``p4runtime/`` (errors, P4Info index, sessions and arbitration, the stream, pipeline
configs, Write, Read); ``cli`` is ``checkmate-switch``; ``testbed``, ``metrics`` and
``benchmark`` run, observe and measure it. What the switch shares with the controller
about the P4 program (P4Info path and index, bytestrings) is in :mod:`checkmate.p4`.
"""
