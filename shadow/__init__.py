"""Shadow nodes: reassemble copied gradients, apply the optimizer, checkpoint.

A shadow node (``checkmate-shadow run``, :mod:`shadow.cli`) is one
:class:`shadow.node.ShadowNode`, composed of components that each own their state, thread
and lock and call each other through typed methods (docs/architecture.md, "The shadow
node: components, threads, locks"); :mod:`shadow.node_state` holds the configuration and
the records they pass (the ``Epoch`` is the one shared by design):

* :mod:`shadow.node_receive` - ``Receiver``, the receive thread: copies and repair answers
  placed into the :class:`~shadow.iteration_window.IterationWindow` (or stashed until their
  commit), with :mod:`shadow.reassembly` doing the byte placement;
* :mod:`shadow.node_control` - ``ControlServer``, the control port: rank 0's job_start,
  bucket_layout and commits (new epochs, re-seeds), status and restore requests;
  :mod:`shadow.node_link` - ``ControlLink``, rank 0's connection and what is written on it;
* :mod:`shadow.node_apply` - ``Applier``, the apply thread: certification, snapshot offers;
* :mod:`shadow.node_service` - ``StateService``: the shard's state, :mod:`shadow.optimizer_apply`
  replaying the workers' optimizer, the fingerprint check, resume from this shadow's
  snapshot, restore answers;
* :mod:`shadow.node_maintenance` - ``Maintenance``: repair requests (:mod:`shadow.repair`),
  the status document and file.

Around it: :mod:`shadow.iteration_window` (the iterations a shadow buffers ahead),
:mod:`shadow.optimizer_apply` (the optimizer replayed on a shard),
:mod:`shadow.reassembly` (datagrams into buckets), :mod:`shadow.repair` (asking workers
for what is missing), :mod:`shadow.snapshots` (the asynchronous disk tier),
:mod:`shadow.cluster` (cluster-wide certification), :mod:`shadow.metrics` (Prometheus),
:mod:`shadow.cli` (``checkmate-shadow``); its benchmarks (apply, fingerprint, disk and
job-state costs, a node's CPU per iteration) live with the experiments
(:mod:`experiments.bench.shadow`, :mod:`experiments.bench.shadow_node`). The client that
fetches the shadows' memory (a checkpoint state source) is
:mod:`checkmate.checkpoint.shadow_memory`: workers use it, so it lives below the stages.
docs/shadow.md describes the behaviour.
"""
