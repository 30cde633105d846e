"""A stand-in for train_lm.py in launcher tests: logs like it, resumes from a file, no torch.

Environment: ``RANK``, ``CHECKMATE_RESUME``; arguments: ``LOG_DIR ITERATIONS MODE``. Rank 0
"certifies" each iteration by writing it to ``LOG_DIR/certified`` after logging it, the way the
shadows hold the state of the iteration before the one the workers are in. MODE: ``ok``;
``fail-at-N`` (rank 1 exits with status 3 during iteration N, in every incarnation, and the others
block there until stopped); ``hang-at-N``
(rank 1 stops logging at iteration N).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    log_dir, iterations, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    certified_file = log_dir / "certified"
    start = 0
    if os.environ.get("CHECKMATE_RESUME") == "1" and certified_file.exists():
        start = int(certified_file.read_text()) + 1
    with open(log_dir / f"rank{rank}.jsonl", "a", encoding="utf-8") as log:

        def write(**record: object) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()

        restored = start - 1 if start else None
        write(event="start", pid=os.getpid(), start_iteration=start, restored_from=restored, time=time.time())
        for iteration in range(start, iterations):
            if mode == f"fail-at-{iteration}":
                if rank == 1:
                    return 3
                time.sleep(3600)  # the others block in iteration N's all-reduce, as real ranks would
            if rank == 1 and mode == f"hang-at-{iteration}":
                time.sleep(3600)
            time.sleep(0.03)
            write(iteration=iteration, loss=1.0 / (iteration + 1), time=time.time(), certified=iteration - 1)
            if rank == 0 and iteration >= 1:  # atomically: a restarted rank may read it any time
                partial = certified_file.with_suffix(".tmp")
                partial.write_text(str(iteration - 1))
                os.replace(partial, certified_file)
        write(event="done", params_sha256="same", optimizer_sha256="same", time=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
