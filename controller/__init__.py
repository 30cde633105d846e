"""The Checkmate controller: programs switches over P4Runtime, per training job.

It installs forwarding from a network description and, for each job, the
replication entries, multicast groups and shadow rewrites the data plane in
p4src/ needs, and keeps a persistent job registry (filled by the controller issue).
"""
