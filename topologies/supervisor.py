"""The process that holds a network while ``checkmate-net up`` has returned to the shell.

``checkmate-net up`` starts ``python -m topologies.supervisor`` in its own
session. The supervisor builds the network (:class:`NetworkRunner`), records
it in the run directory's ``state.json`` as it goes, sets the status to
``up`` (or ``failed`` with the error), and then waits. SIGTERM, SIGINT or
SIGHUP make it take the network down in order and exit. A signal during the
bring-up aborts it and takes down the part already created.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from checkmate.p4.program import Target
from topologies.preflight import PreflightError, make_plan
from topologies.runstate import FAILED, RUN_ENV, STOPPED, STOPPING, UP, RunState, process_start_time

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0
MAX_SWITCH_RESTARTS = 5
"""Restarts of one switch process before the supervisor gives up on it (and records the error)."""


class Interrupted(Exception):
    """A stop signal arrived during the bring-up."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m topologies.supervisor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("network", type=Path)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--target", choices=[t.value for t in Target], default=Target.EMBEDDED.value)
    parser.add_argument("--pcap", action="store_true")
    parser.add_argument("--switch-args", action="append", default=[], help="see checkmate-net up")
    parser.add_argument("--state-dir", type=Path, default=None, help="controller registry (checkmate-ctl's)")
    parser.add_argument("--tls-dir", type=Path, default=None, help="mutual TLS PKI (checkmate-net up)")
    parser.add_argument("--switch-ready-timeout", type=float, default=30.0)
    parser.add_argument(
        "--no-restart-switches",
        dest="restart_switches",
        action="store_false",
        help="leave a switch process that died down (default: restart it, push the pipeline, reconcile)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    state = RunState(
        run_dir=str(run_dir),
        network_file=str(args.network.resolve()),
        target=args.target,
        supervisor_pid=pid,
        supervisor_start_time=process_start_time(pid) or 0,
        controller_state_dir=str(args.state_dir or ""),
    )
    state.save()

    stop = threading.Event()
    starting = True

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.info("signal %s: taking the network down", signal.Signals(signum).name)
        stop.set()
        if starting:
            raise Interrupted(f"interrupted by {signal.Signals(signum).name} during the bring-up")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    # Imported here: they import Mininet, which must not be needed to parse arguments.
    from topologies.network_runner import BringUpError, NetworkRunner, Timeouts

    runner: NetworkRunner | None = None
    status = 0
    try:
        plan = make_plan(
            args.network,
            Target(args.target),
            run_dir,
            pcap=args.pcap,
            switch_args=args.switch_args,
            tls_dir=args.tls_dir,
        )
        # Mininet's node shells inherit this process's environment: mark them as ours.
        os.environ[RUN_ENV] = str(plan.run_dir)
        runner = NetworkRunner(
            plan,
            state,
            controller_state_dir=args.state_dir,
            timeouts=Timeouts(switch_ready_s=args.switch_ready_timeout),
            environ=os.environ,
        )
        runner.start()
        starting = False
        state.status = UP
        state.save()
        logger.info("network up: %s", args.network)
        reported: set[str] = set()
        restarts: dict[str, int] = {}
        while not stop.wait(WATCH_INTERVAL_S):
            for name, why in runner.dead_switches().items():
                if name in reported:
                    continue
                if args.restart_switches and restarts.get(name, 0) < MAX_SWITCH_RESTARTS:
                    restarts[name] = restarts.get(name, 0) + 1
                    logger.warning("switch %s %s; restarting it (restart %d)", name, why, restarts[name])
                    try:
                        runner.restart_switch(name)
                        logger.info("switch %s restarted and programmed (pipeline, routes, jobs)", name)
                        continue
                    except BringUpError as exc:
                        why = f"{why}; restarting it failed: {exc}"
                reported.add(name)
                logger.error("switch %s %s", name, why)
                state.error = "; ".join(filter(None, [state.error, f"switch {name} {why}"]))
                state.save()
    except (PreflightError, Interrupted) as exc:
        status = _failed(state, str(exc))
    except Exception as exc:  # noqa: BLE001  any failure must be recorded and the half-built network taken down
        logger.exception("bring-up failed")
        status = _failed(state, f"{type(exc).__name__}: {exc}")
    finally:
        starting = False
        if state.status != FAILED:
            state.status = STOPPING
            state.save()
        if runner is not None:
            try:
                runner.stop()
            except Exception:  # noqa: BLE001  teardown goes on; `checkmate-net down` removes leftovers
                logger.exception("taking the network down failed; `checkmate-net down` cleans up")
        if state.status != FAILED:
            state.status = STOPPED
            state.save()
    return status


def _failed(state: RunState, error: str) -> int:
    logger.error("%s", error)
    state.status = FAILED
    state.error = error
    state.save()
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
