"""The emulated network: Checkmate topologies in Mininet, on BMv2 or the embedded switch.

This folder holds the network descriptions (``single.json``, ``leafspine.json``;
the JSON shape of p4lang/tutorials, validated by :mod:`checkmate.network`) and
the code behind ``checkmate-net``, which brings a description up in Mininet,
programs it through the controller, and takes it down again without leaving
interfaces, namespaces or processes behind.

Modules, in the order a bring-up uses them: :mod:`~topologies.preflight`
(everything checked before anything is created), :mod:`~topologies.mininet_import`
(Debian's Mininet from ``.venv``), :mod:`~topologies.targets` (switch command
lines), :mod:`~topologies.switches` and :mod:`~topologies.hosts` (Mininet
nodes), :mod:`~topologies.network_runner` (the bring-up itself),
:mod:`~topologies.supervisor` (the process that holds the network while
``up`` has returned), :mod:`~topologies.runstate` and :mod:`~topologies.cleanup`
(what was created, and taking it away), :mod:`~topologies.cli`. The programs
that run inside the hosts are in ``examples/``; the jobs that use the network
(``make demo``, ``make bench``, the launcher) are in ``experiments/``.
"""
