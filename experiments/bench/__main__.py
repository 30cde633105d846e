"""``python -m experiments.bench``: ``make bench`` (see :mod:`experiments.bench.cli`)."""

from __future__ import annotations

import sys

from experiments.bench.cli import main

sys.exit(main())
