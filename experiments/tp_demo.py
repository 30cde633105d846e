"""``make demo DEMO_ARGS="--tp 2"``: a TP x DP job on the emulated switch, one Checkmate lane per TP index.

The four workers h1-h4 train :mod:`examples.train_tp` (the tiny transformer under
torch tensor parallelism, DDP over each TP index's DP group): rank r = dp_index * TP
+ tp_index runs in ``workers[r]``, so with TP=2 lane 0 is h1, h3 and lane 1 is h2, h4.
Every lane is a job at the switch (job id ``job_id + t``, its own shadows: sh1 for lane
0, sh2 for lane 1, its own secret) whose tagged all-gather packets the switch copies to
that lane's shadows; the TP collectives (gloo) and both rings cross the same emulated
switch. Steps, with :class:`~experiments.job.JobRun`'s public ones:

1. **network** (``prepare``, ``bring_up_network``);
2. **lanes**: ``checkmate-ctl job add --tp-degree T`` registers every lane (each with a
   secret of its own in the registry), one job file per lane (``job-file-tp<t>.json``: the
   lane's job, its ``tp_degree``/``tp_index``, its secret); the workers find theirs through
   ``{tp_index}`` in ``CHECKMATE_JOB_FILE``;
3. **shadows**: each lane's shadows in their hosts, snapshotting every iteration into
   the lane's own directory (``snapshots/lane<t>``);
4. **training**: ``JobRun.train`` with the workers' command and environment changed
   through :attr:`~experiments.job.JobHooks.launch` (``CHECKMATE_TP_DEGREE``, the lanes'
   job files); rank ``--kill-rank`` is killed (SIGKILL) during ``--kill-at`` and all
   workers restart with ``CHECKMATE_RESUME=1``: ``hosts.resume`` restores every rank from
   its own lane's shadows, all lanes at one iteration (:mod:`hosts.recovery`);
5. **verify**: per lane, the shadows' state (fetched from their memory inside a
   worker host) against the digests of that lane's workers;
6. **merge**: the lanes' latest common snapshot merged into one universal checkpoint
   (:func:`~checkmate.universal.shadow_merge.merge_lane_snapshots`), loaded as TP=1
   (its loss on a fixed batch against the TP job's) and back as TP=``--tp`` (each
   lane's parameters against its workers' digest);
7. **reference** (unless ``--no-reference``): the same TP job without the failure (the lanes
   removed at the switch, job files without shadows); the recovered run must end with
   every rank's parameters and optimizer state bit-identical to it;
8. **teardown**, always.

The figures (:func:`run_tp_demo`'s summary, ``results/demo-tp.json``; no plot): per lane
whether its shadows equal its workers; ``lost_iterations``: iterations the workers had
finished before the kill and did again after it (from the workers' logs), and
``lost_iterations_measured``: the same as the shadows measured it at the restore
(:attr:`hosts.recovery.ResumePoint.lost_iterations`); where each lane's state came from;
``recovered_equals_uninterrupted``. ``ok`` holds when every check passed and no finished
iteration was lost.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from checkmate.control import DEFAULT_CONTROL_PORT
from checkmate.p4.names import ShadowCopies
from checkmate.wire import CHECKMATE_UDP_PORT
from experiments.commands import NET, REPO, JobError, secret_env
from experiments.job import JobConfig, JobHooks, JobRun
from experiments.launcher import LaunchConfig
from experiments.progress import Observer
from experiments.results import RunSeries
from experiments.shadows import ShadowProcesses

logger = logging.getLogger(__name__)

TP_WORKERS = ("h1", "h2", "h3", "h4")


@dataclass
class Lane:
    """One TP index's DP group: a job at the switch with its own shadows and snapshot directory."""

    index: int
    job_id: int
    workers: tuple[str, ...]
    shadows: tuple[str, ...]
    job_file: Path
    processes: ShadowProcesses


class TpDemo:
    """Runs the TP demo once on a :class:`JobRun`'s network; :meth:`run` always tears down."""

    def __init__(self, config: JobConfig, tp: int, observer: Observer | None = None) -> None:
        config = replace(config, workers=TP_WORKERS, worker_module="examples.train_tp")
        if tp < 2 or len(config.workers) % tp or len(config.shadows) % tp:
            raise JobError(
                f"--tp {tp}: needs 2 or more, dividing the {len(config.workers)} workers and "
                f"{len(config.shadows)} shadows"
            )
        if config.elastic or config.shadows_fail_too:
            raise JobError("--tp: --elastic and --shadows-fail-too are not available for a TP job's demo")
        if config.kill_iteration is not None and not 0 <= config.kill_rank < len(config.workers):
            ranks = len(config.workers)
            raise JobError(f"--kill-rank {config.kill_rank}: the TP job has ranks 0..{ranks - 1}")
        self.config = config
        self.tp = tp
        self.observer = observer or Observer()
        self.job_run = JobRun(config, self.observer, JobHooks(launch=self._launch))
        work = self.job_run.work
        self.merged_dir = work / "merged"
        self.lanes = [
            Lane(
                index=t,
                job_id=config.job_id + t,
                workers=config.workers[t::tp],
                shadows=config.shadows[t::tp],
                job_file=work / f"job-file-tp{t}.json",
                processes=ShadowProcesses(
                    replace(config, job_id=config.job_id + t, shadows=config.shadows[t::tp]),
                    self.job_run.net_dir,
                    self.job_run.snapshot_dir / f"lane{t}",
                    self.job_run.log_dir,
                    work / f"job-file-tp{t}.json",
                    self.job_run.address,
                    self.observer,
                ),
            )
            for t in range(tp)
        ]

    # ---- the sequence ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        series = RunSeries("main")
        summary: dict[str, Any] = {"tp": self.tp, "dp": len(self.config.workers) // self.tp}
        try:
            self.job_run.prepare()
            self.job_run.bring_up_network()
            self.add_lanes()
            self.start_shadows()
            self.job_run.train(series, self.config.kill_iteration, with_shadows=True)
            assert series.result is not None
            done = series.result.done
            summary.update(self.recovery(series))
            summary["lanes"] = [self.verify_lane(lane, done) for lane in self.lanes]
            summary.update(self.merge(done))
            for lane in self.lanes:
                lane.processes.stop()
            if self.config.reference:
                summary.update(self.reference(done))
        finally:
            for lane in self.lanes:
                if lane.processes:
                    lane.processes.stop()
            self.job_run.teardown()
            summary["seconds"] = round(time.monotonic() - started, 1)
        losses = series.mean_loss(0)
        summary.update(
            iterations=self.config.iterations,
            workers=list(self.config.workers),
            first_loss=round(losses[min(losses)], 4) if losses else None,
            final_loss=round(losses[max(losses)], 4) if losses else None,
        )
        return summary

    # ---- steps ----------------------------------------------------------------------------------
    def add_lanes(self) -> None:
        """Every lane a job at the switch (``job add --tp-degree``), each with its own secret and job file."""
        self.observer.phase("job", len(self.lanes))
        self.job_run.ctl(
            "job", "add", "--job-id", str(self.config.job_id), "--workers", ",".join(self.config.workers),
            "--shadows", ",".join(self.config.shadows), "--tp-degree", str(self.tp),
        )  # fmt: skip
        for lane in self.lanes:
            shown = self.job_run.ctl("job", "show", str(lane.job_id), "--json", "--no-shadows")
            job = json.loads(shown.stdout)["job"]
            said = (tuple(job["workers"]), tuple(job["shadows"]), job.get("tp_index"), job.get("tp_degree"))
            if said != (lane.workers, lane.shadows, lane.index, self.tp):
                raise JobError(f"lane {lane.index}: the registry holds job {lane.job_id} as {job}")
            secret_path = Path(self.job_run.ctl("job", "secret", str(lane.job_id)).stdout.strip())
            self.write_lane_file(lane, lane.job_file, job, secret_path.read_text().strip(), with_shadows=True)
            self.observer.advance("job", lane.index + 1, f"lane {lane.index}: job {lane.job_id}")
        self.observer.phase_done(
            "job",
            "; ".join(f"lane {ln.index}: job {ln.job_id} {','.join(ln.workers)}" for ln in self.lanes)
            + "; a secret per lane",
        )

    def write_lane_file(
        self, lane: Lane, path: Path, job: dict[str, Any], secret: str, with_shadows: bool
    ) -> None:
        """Lane ``lane``'s job file (0600): its job, its workers' ring, its shadows (or none), its secret."""
        document = {
            "job": job,
            "worker_addresses": [f"{self.job_run.address(w)}:{CHECKMATE_UDP_PORT}" for w in lane.workers],
            "shadow_control": {s: f"{self.job_run.address(s)}:{DEFAULT_CONTROL_PORT}" for s in lane.shadows}
            if with_shadows
            else {},
            "secret": secret,
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(document, indent=1))

    def start_shadows(self) -> None:
        self.observer.phase("shadows", len(self.config.shadows))
        for lane in self.lanes:
            for name in lane.shadows:
                lane.processes.start(name)
        for lane in self.lanes:
            lane.processes.wait_ready(lane.shadows)
        self.observer.phase_done(
            "shadows", "; ".join(f"lane {ln.index}: {','.join(ln.shadows)}" for ln in self.lanes)
        )

    def _launch(self, launch: LaunchConfig) -> LaunchConfig:
        """The workers run train_tp with every DP group a lane (each its lane's job file and secret)."""
        config = self.config
        reference = launch.log_dir == self.job_run.reference_log_dir
        command: tuple[str, ...] = (config.python, "-m", "examples.train_tp", "--tp", str(self.tp))
        command += ("--iterations", str(config.iterations), "--log", str(launch.log_dir / "rank{rank}.jsonl"))
        command += ("--snapshot-dir", str(self.job_run.snapshot_dir / "lane{tp_index}"))
        files = "job-file-reference-tp{tp_index}.json" if reference else "job-file-tp{tp_index}.json"
        env = {
            **launch.env,
            "CHECKMATE_TP_DEGREE": str(self.tp),
            "CHECKMATE_JOB_FILE": str(self.job_run.work / files),  # {tp_index}: hosts and checkmate.auth
            "CHECKMATE_JOB_SECRET": "",  # each lane's secret is in its job file
            "CHECKMATE_JOB_SECRET_FILE": "",
        }
        restarts = 0 if reference or config.kill_iteration is None else config.max_restarts
        return replace(launch, command=command, env=env, max_restarts=restarts)

    def recovery(self, series: RunSeries) -> dict[str, Any]:
        """The kill and the restart, from the launcher and the workers' ``start`` records."""
        result = series.result
        assert result is not None
        if len(result.incarnations) < 2:
            return {"killed": None, "restarts": result.restarts, "lost_iterations": 0}
        killed, resumed = result.incarnations[0], result.incarnations[1]
        start = series.starts.get(1, {})
        lost = result.lost_iterations()
        out = {
            "killed": killed.killed,
            "restarts": result.restarts,
            "completed_before_kill": killed.completed_through,
            "resumed_from_iteration": resumed.start_iteration,
            "restored_checkpoint_iteration": resumed.restored_from,
            "restore_source": resumed.source,
            "lost_iterations": lost[0],
            "lost_iterations_measured": start.get("lost_iterations"),
            "lane_restores": start.get("lanes", []),
        }
        where = ", ".join(f"lane {ln['tp_index']} from {ln['source']}" for ln in out["lane_restores"])
        self.observer.say(
            f"recovered: every lane restored iteration {resumed.restored_from} ({where}); the workers had "
            f"finished {killed.completed_through}: {lost[0]} finished iteration(s) lost "
            f"(the shadows measured {start.get('lost_iterations')})"
        )
        return out

    def reference(self, done: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The same TP job without the failure and without shadows; every rank's final state against it."""
        for lane in self.lanes:
            job = json.loads(lane.job_file.read_text())
            path = self.job_run.work / f"job-file-reference-tp{lane.index}.json"
            self.write_lane_file(lane, path, job["job"], job["secret"], with_shadows=False)
            self.job_run.ctl("job", "remove", str(lane.job_id))
        series = RunSeries("reference")
        self.job_run.train(series, None, with_shadows=False)
        assert series.result is not None
        ref = series.result.done
        ranks = sorted(done)
        equal = ranks == sorted(ref) and all(
            (done[r]["params_sha256"], done[r]["optimizer_sha256"])
            == (ref[r]["params_sha256"], ref[r]["optimizer_sha256"])
            for r in ranks
        )
        self.observer.say(f"recovered run equals the uninterrupted one, every rank bit for bit: {equal}")
        return {"recovered_equals_uninterrupted": equal}

    def verify_lane(self, lane: Lane, done: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Lane ``lane``'s shadows' final state (from their memory) against its workers' digests."""
        config = self.config
        out = self.job_run.work / f"shadow-digest-tp{lane.index}.json"
        out.unlink(missing_ok=True)
        argv = [config.python, "-m", "checkmate.checkpoint.shadow_memory", "digest"]
        argv += ["--iteration", str(config.iterations - 1)]
        argv += ["--timeout", str(config.verify_timeout / 2), "--out", str(out)]
        for name, address in lane.processes.control().items():
            argv += ["--shadow", f"{name}={address}"]
        try:
            subprocess.run(
                [*NET, "exec", "--run-dir", str(self.job_run.net_dir), lane.workers[0], "--", *argv],
                env=secret_env(lane.job_file),
                capture_output=True,
                timeout=config.verify_timeout,
                cwd=REPO,
                check=False,
            )
            digest: dict[str, Any] = json.loads(out.read_text())
        except (subprocess.TimeoutExpired, OSError, json.JSONDecodeError) as exc:
            raise JobError(f"lane {lane.index}: the shadows' state could not be fetched: {exc}") from None
        ranks = sorted(r for r, record in done.items() if record.get("tp_index") == lane.index)
        params = {done[r]["params_sha256"] for r in ranks}
        optimizer = {done[r]["optimizer_sha256"] for r in ranks}
        equal = bool(
            digest.get("ok")
            and len(params) == 1
            and len(optimizer) == 1
            and digest.get("params_sha256") in params
            and digest.get("optimizer_sha256") in optimizer
            and digest.get("iteration") == config.iterations - 1
        )
        shown = json.loads(self.job_run.ctl("job", "show", str(lane.job_id), "--json").stdout)
        counters = shown.get("counters", {})
        packets = sum(s.get(ShadowCopies.NAME, {}).get("packets", 0) for s in counters.values())
        self.observer.say(
            f"lane {lane.index} (job {lane.job_id}, ranks {ranks}): shadows equal the workers: {equal}; "
            f"the switch copied {packets} packets to its shadows"
        )
        return {
            "tp_index": lane.index,
            "job_id": lane.job_id,
            "workers": list(lane.workers),
            "shadows": list(lane.shadows),
            "ranks": ranks,
            "shadow_equals_workers": equal,
            "shadow_copies_packets": packets,
            "shadow_params_sha256": digest.get("params_sha256"),
        }

    def merge(self, done: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The lanes' snapshots as one universal checkpoint, restored as TP=1 and back as TP=tp."""
        import torch
        import torch.nn.functional as F

        from checkmate import checkpoint as fmt
        from checkmate.checkpoint.digest import parameters_digest
        from checkmate.universal.layout import Layout
        from checkmate.universal.load import load_module, load_rank
        from checkmate.universal.shadow_merge import lane_steps, merge_lane_snapshots
        from checkmate.universal.tiny import EVAL_STEP, TinyConfig, batch, build, logical_shapes, tiny_spec

        self.observer.phase("merge", 1)
        roots = [lane.processes.snapshot_dir for lane in self.lanes]
        deadline = time.monotonic() + 30  # the shadows' last snapshot may still be on its way to disk
        while self.config.iterations - 1 not in lane_steps(roots) and time.monotonic() < deadline:
            time.sleep(0.2)
        config = TinyConfig()
        step = merge_lane_snapshots(roots, self.merged_dir, tiny_spec(config), logical_shapes(config))
        reader = fmt.CheckpointReader(self.merged_dir, step)
        model = build(config, Layout(), 0)
        load_module(reader, model, None, Layout(), 0)
        with torch.no_grad():
            tokens = batch(config, EVAL_STEP)
            logits = model(tokens[:, :-1])
            tp1_loss = float(F.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1)))
        tp_loss = float(done[0]["eval_loss"])
        back = []
        for lane in self.lanes:
            state = load_rank(reader, Layout(tp=self.tp), lane.index)
            ranks = sorted(r for r, record in done.items() if record.get("tp_index") == lane.index)
            back.append(parameters_digest(state.params) == done[ranks[0]]["params_sha256"])
        info = (
            f"step {step}: as TP=1 loss {tp1_loss:.6f} (TP={self.tp} job: {tp_loss:.6f}); "
            f"back as TP={self.tp} bit-identical: {all(back)}"
        )
        self.observer.phase_done("merge", info)
        return {
            "merged_step": step,
            "merged_dir": str(self.merged_dir),
            "tp1_eval_loss": tp1_loss,
            "tp_eval_loss": tp_loss,
            "tp1_loss_relative_difference": abs(tp1_loss - tp_loss) / abs(tp_loss),
            "back_to_tp_equals_workers": all(back),
        }


def run_tp_demo(config: JobConfig, tp: int, observer: Observer | None = None) -> tuple[dict[str, Any], bool]:
    """Run it; (the summary, whether every check passed). Writes ``demo-tp.json`` to ``results_dir``."""
    summary = TpDemo(config, tp, observer).run()
    ok = (
        all(lane["shadow_equals_workers"] for lane in summary.get("lanes", []))
        and bool(summary.get("back_to_tp_equals_workers"))
        and summary.get("tp1_loss_relative_difference", 1.0) < 1e-5
        and summary.get("lost_iterations") == 0
        and (config.kill_iteration is None or summary.get("restarts") == 1)
        and summary.get("recovered_equals_uninterrupted", not config.reference) is True
    )
    summary["ok"] = ok
    if config.results_dir is not None:
        config.results_dir.mkdir(parents=True, exist_ok=True)
        (config.results_dir / "demo-tp.json").write_text(json.dumps(summary, indent=1))
    return summary, ok


def tp_main(console: Any, config: JobConfig, tp: int) -> int:
    """``python -m experiments.demo --tp N``: run it with the progress display; 0 when every check passed."""
    import signal
    from types import FrameType

    from experiments.progress import RichObserver

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    console.print(
        f"[bold]Checkmate TP demo[/]: TP={tp} x DP={len(TP_WORKERS) // tp} on {', '.join(TP_WORKERS)}, "
        "one lane (job, shadows, secret) per TP index on one emulated P4 switch; "
        + (
            f"rank {config.kill_rank} is killed during iteration {config.kill_iteration}."
            if config.kill_iteration is not None
            else "no failure."
        )
    )
    try:
        with RichObserver() as observer:
            summary, ok = run_tp_demo(config, tp, observer)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: workers and shadows stopped, the network taken down.")
        return 130
    except (JobError, ValueError) as exc:
        console.print(f"[red]demo failed[/]: {exc}")
        console.print(f"everything the demo started was stopped; its logs are in {config.work_dir}")
        return 1
    for lane in summary["lanes"]:
        console.print(
            f"lane {lane['tp_index']} (job {lane['job_id']}, {', '.join(lane['workers'])} -> "
            f"{', '.join(lane['shadows'])}): shadows equal workers {lane['shadow_equals_workers']}, "
            f"{lane['shadow_copies_packets']} copies"
        )
    console.print(
        f"merged step {summary['merged_step']}: TP=1 loss {summary['tp1_eval_loss']:.6f} vs TP={tp} "
        f"{summary['tp_eval_loss']:.6f}; back as TP={tp} equal to the workers: "
        f"{summary['back_to_tp_equals_workers']}"
    )
    if summary.get("killed") is not None:
        killed = summary["killed"]
        console.print(
            f"killed rank {killed.get('rank')} ({killed.get('host')}) during iteration "
            f"{killed.get('iteration')}; "
            f"every lane restored iteration {summary['restored_checkpoint_iteration']} ("
            + ", ".join(f"lane {ln['tp_index']}: {ln['source']}" for ln in summary["lane_restores"])
            + f"); lost iterations: {summary['lost_iterations']} (the shadows measured "
            f"{summary['lost_iterations_measured']})"
        )
    if "recovered_equals_uninterrupted" in summary:
        console.print(
            "recovered run bit-identical to the uninterrupted one (every rank's parameters and optimizer "
            f"state): {summary['recovered_equals_uninterrupted']}"
        )
    if config.results_dir is not None:
        console.print(f"results: {config.results_dir / 'demo-tp.json'}")
    console.print("[green]every check passed[/]" if ok else "[red]a check failed[/] (see above)")
    return 0 if ok else 1
