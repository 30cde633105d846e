"""``python -m experiments.bench.storage_probe URL BYTES [WRITES]``: the NFS write rate, as JSON on stdout.

Run by :func:`experiments.bench.emulation.remote_storage_rate` inside a worker host's
namespaces, so that the bytes take the workers' path to the storage host: the emulated
switch and the shaped link. Each write is ``BYTES`` of random data through
:mod:`checkmate.nfs` (as a peer's ``torch.save`` writes): ``written`` when the server has
answered every WRITE, ``durable`` after the COMMIT and CLOSE; ``cpu_s``: the CPU time this
process spent on each write (the client's work, on the workers' CPU set: what a background
persist takes from training even when it hides the wait). Exit 1 with the error on stderr.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from checkmate import nfs

CHUNK = 4 << 20


def probe(url: str, nbytes: int, writes: int, timeout: float = nfs.DEFAULT_TIMEOUT_S) -> dict[str, object]:
    chunk = os.urandom(min(CHUNK, nbytes))
    written: list[float] = []
    durable: list[float] = []
    cpu: list[float] = []
    client, directory = nfs.NFSClient.from_url(url, timeout)
    with client:
        client.makedirs(directory)
        for i in range(writes):
            path = f"{directory.rstrip('/')}/.storage-probe-{os.getpid()}-{i}"
            started, cpu_started = time.perf_counter(), time.process_time()
            stream = client.open(path, "wb", buffering=0)
            try:
                left = nbytes
                while left > 0:
                    left -= stream.write(chunk[: min(left, len(chunk))])
                written.append(time.perf_counter() - started)
            finally:
                stream.close()  # COMMIT, then CLOSE
            durable.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            client.unlink(path)
    return {
        "url": url,
        "bytes": nbytes,
        "writes": writes,
        "written_MBps": nbytes / statistics.median(written) / 1e6,
        "durable_MBps": nbytes / statistics.median(durable) / 1e6,
        "written_s": [round(s, 6) for s in written],
        "durable_s": [round(s, 6) for s in durable],
        "cpu_s": [round(s, 6) for s in cpu],
        "cpu_s_per_write": statistics.median(cpu),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3):
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    try:
        found = probe(args[0], int(args[1]), int(args[2]) if len(args) == 3 else 3)
    except (nfs.NFSError, ValueError) as exc:
        print(f"storage probe: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
