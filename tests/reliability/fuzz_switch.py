"""An embedded switch programmed the way the controller programs it, for the switch fuzz tests.

:func:`programmed_switch` starts a :class:`P4RuntimeServer` in-process on 127.0.0.1,
points topologies/single.json at it, has a real :class:`Controller` install
forwarding and two jobs over P4Runtime, and returns the pipeline that runs the
server's state together with a :class:`SwitchModel` built from the controller's
planned entities (``Controller.desired_state``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from checkmate.job import JobSpec
from checkmate.network import Network, mac_to_int
from controller.controller import Controller
from embedded_switch.native import make_pipeline
from embedded_switch.p4runtime_server import P4RuntimeServer
from embedded_switch.pipeline import Pipeline
from embedded_switch.state import SwitchState
from tests.reliability.fuzz_frames import SwitchModel

REPO = Path(__file__).resolve().parents[2]
SWITCH = "s1"
JOB_A = JobSpec(7, ("h1", "h2", "h3", "h4"), ("sh1", "sh2"))
JOB_B = JobSpec(8, ("h3", "h4"), ("sh2",))
"""Two jobs: job 8's worker ports (3, 4) are also job 7's; ports 1 and 2 are job 7's only."""


@dataclass
class ProgrammedSwitch:
    network: Network
    server: P4RuntimeServer
    state: SwitchState
    pipeline: Pipeline
    model: SwitchModel
    slots: dict[int, int]
    """job id -> counter slot."""

    def host_port(self, host: str) -> int:
        return self.network.attachment(host)[1]

    def host_mac(self, host: str) -> int:
        return mac_to_int(self.network.hosts[host].mac)

    def host_ip(self, host: str) -> int:
        return int(self.network.hosts[host].address)

    def switch_mac(self, host: str) -> int:
        return mac_to_int(self.network.port_mac(SWITCH, self.host_port(host)))

    def shadow_ports(self) -> set[int]:
        return {self.host_port(h) for h in self.network.hosts_with_role("shadow")}

    def counter_total(self, name: str) -> int:
        return sum(self.state.counter(name).packets)


@contextmanager
def programmed_switch(tmp: Path, datapath: str = "python") -> Iterator[ProgrammedSwitch]:
    """``datapath``: the pipeline's, ``python`` or ``native`` (embedded_switch.native)."""
    data = json.loads((REPO / "topologies" / "single.json").read_text())
    server = P4RuntimeServer(data["switches"][SWITCH]["device_id"], "127.0.0.1:0")
    data["switches"][SWITCH]["grpc"] = f"127.0.0.1:{server.start()}"
    try:
        server.load_default_pipeline()
        network = Network.from_json(data)
        with Controller(network, tmp / "controller-state", timeout=5.0) as controller:
            controller.install_forwarding()
            slots = {spec.job_id: controller.add_job(spec).slot for spec in (JOB_A, JOB_B)}
            entities = controller.desired_state()[SWITCH].values()
        state = server.state
        assert state is not None
        yield ProgrammedSwitch(
            network, server, state, make_pipeline(datapath, state), SwitchModel.from_entities(entities), slots
        )
    finally:
        server.stop(grace=0.1)
