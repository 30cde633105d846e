"""The reliability suite: faults injected into real training, and bad input into every entry point.

Each test records one row per fault or input class (:mod:`tests.reliability.record`);
``make reliability`` (quick cases) and ``make soak`` (quick and soak cases) render
the rows into ``docs/reliability.md`` (:mod:`tests.reliability.report`).
"""
