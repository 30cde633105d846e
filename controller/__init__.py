"""The Checkmate controller: programs switches over P4Runtime, per training job.

It installs forwarding from a network description (:mod:`checkmate.network`)
and, for each job, the replication entries, multicast groups and shadow
rewrites the data plane in p4src/ needs, keeps a persistent job registry, and
reconciles the switches with it. Modules are named after the P4 block they
fill (``route_ipv4``, ``replication``, ``pre``, ``shadow_rewrite``);
:class:`controller.controller.Controller` ties them together and
``checkmate-ctl`` (:mod:`controller.cli`) drives it. docs/controller.md
describes what is written per job. P4Info names resolve to ids through
:class:`checkmate.p4.p4info.P4InfoIndex` (shared with the embedded switch); the
shadows' status comes from :func:`checkmate.control.query_status`.
"""
