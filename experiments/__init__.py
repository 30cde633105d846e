"""Experiments: Checkmate jobs run on the emulated network — ``make demo``, ``make bench`` and the rest.

:mod:`~experiments.job` (:class:`~experiments.job.JobRun`: one job on a
private network, its steps public, what a caller adds going through
:class:`~experiments.job.JobHooks`), :mod:`~experiments.launcher` (workers in
hosts, restarted from the shadows), :mod:`~experiments.shadows`,
:mod:`~experiments.results`, :mod:`~experiments.progress` (what a run shows),
:mod:`~experiments.plots`, :mod:`~experiments.commands` (how the tools are
called); :mod:`~experiments.demo` is ``make demo``, :mod:`experiments.bench`
``make bench``. See README.md.
"""
