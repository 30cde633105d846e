"""The embedded switch's description of the program it interprets is checked against the P4Info at load.

embedded_switch.program.PIPELINE says which tables the interpreter looks up, with the key
fields in the order it passes them, and which actions it acts on, with the parameters in the
order it unpacks them. A P4Info in which one of those was renamed, dropped or reordered is
refused when it is loaded or pushed, naming what differs, instead of being misread.
"""

from __future__ import annotations

import pytest
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4 import names
from checkmate.p4.generate_names import class_name
from checkmate.p4.p4info import load_p4info
from embedded_switch import program
from embedded_switch.p4runtime.config import PipelineStore
from embedded_switch.p4runtime.errors import Failure


def copy_of_committed() -> p4info_pb2.P4Info:
    info = p4info_pb2.P4Info()
    info.CopyFrom(load_p4info())
    return info


def rename_table(info: p4info_pb2.P4Info, old: str, new: str) -> None:
    table = next(t for t in info.tables if t.preamble.alias == old)
    table.preamble.name = table.preamble.name.replace(old, new)
    table.preamble.alias = new


def test_the_description_matches_the_committed_p4info() -> None:
    program.check_pipeline(load_p4info())
    assert [use.table for use in program.PIPELINE] == list(names.TABLES)
    for use in program.PIPELINE:
        assert use.key == names.TABLES[use.table]
        assert use.default_action == getattr(names, class_name(use.table)).DEFAULT_ACTION


def test_a_renamed_table_is_refused_at_load_naming_it() -> None:
    info = copy_of_committed()
    rename_table(info, "route_ipv4", "route_v4")
    with pytest.raises(program.ProgramMismatchError) as error:
        program.build_state(info)
    message = str(error.value)
    assert "it has no table route_ipv4" in message
    assert "tables the pipeline never applies: ['route_v4']" in message


def test_reordered_key_fields_and_renamed_parameters_are_refused() -> None:
    info = copy_of_committed()
    replicate = next(t for t in info.tables if t.preamble.alias == "replicate_to_shadow")
    fields = list(replicate.match_fields)
    fields[0], fields[1] = fields[1], fields[0]
    del replicate.match_fields[:]
    replicate.match_fields.extend(fields)
    forward = next(a for a in info.actions if a.preamble.alias == "forward")
    forward.params[1].name, forward.params[2].name = "dst_mac", "src_mac"
    with pytest.raises(program.ProgramMismatchError) as error:
        program.check_pipeline(info)
    message = str(error.value)
    assert (
        "table replicate_to_shadow matches ('ingress_port', 'job_id', 'shard_key', 'next_hop_port'), "
        "the pipeline looks it up by ('job_id', 'ingress_port', 'shard_key', 'next_hop_port')"
    ) in message
    assert "action forward takes ('port', 'dst_mac', 'src_mac'), the pipeline unpacks" in message


def test_a_missing_counter_or_action_is_refused() -> None:
    info = copy_of_committed()
    kept = [c for c in info.counters if c.preamble.alias != "shadow_copies"]
    del info.counters[:]
    info.counters.extend(kept)
    rewrite = next(t for t in info.tables if t.preamble.alias == "rewrite_shadow_copy")
    ids = {a.preamble.alias: a.preamble.id for a in info.actions}
    kept_refs = [r for r in rewrite.action_refs if r.id != ids["set_shadow_destination"]]
    del rewrite.action_refs[:]
    rewrite.action_refs.extend(kept_refs)
    with pytest.raises(program.ProgramMismatchError) as error:
        program.check_pipeline(info)
    assert "table rewrite_shadow_copy has no action set_shadow_destination" in str(error.value)
    assert "it has no counter shadow_copies" in str(error.value)


def test_a_switch_whose_own_p4info_differs_refuses_the_push_as_invalid() -> None:
    """The committed P4Info regenerated with a rename, Python not updated: every push is refused."""
    info = copy_of_committed()
    rename_table(info, "lookup_job", "job_slots")
    store = PipelineStore(0, info)
    with pytest.raises(Failure) as error:
        store.prepare(p4runtime_pb2.ForwardingPipelineConfig(p4info=info))
    assert "it has no table lookup_job" in error.value.message
