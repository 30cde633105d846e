"""embedded_switch.native without root: choosing the data path; the fallback without the extension."""

from __future__ import annotations

import logging

import pytest

from checkmate.p4.p4info import load_p4info
from embedded_switch import native
from embedded_switch.pipeline import Pipeline
from embedded_switch.ports import PortsConfig, SwitchPorts
from embedded_switch.program import build_state
from tests import switch_cases as sc


def test_python_is_always_available_and_unknown_names_are_refused() -> None:
    assert native.resolve_datapath("python") == "python"
    with pytest.raises(ValueError, match="unknown data path"):
        native.resolve_datapath("dpdk")
    assert native.DATAPATHS[0] == "native"  # the default


def test_without_the_extension_native_falls_back_to_python_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_datapath", None)
    monkeypatch.setattr(native, "IMPORT_ERROR", "No module named '_datapath'")
    monkeypatch.setattr(native, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="embedded_switch.native"):
        assert native.resolve_datapath("native") == "python"
        assert native.resolve_datapath("native") == "python"
        state = build_state(load_p4info())
        sc.install(state)
        ports = SwitchPorts(PortsConfig(bindings=()), state=state)  # no interfaces: no root needed
        try:
            assert ports.datapath == "python"
            assert type(ports._pipeline) is Pipeline
        finally:
            ports.stop()
    warnings = [r for r in caplog.records if "native data path is not available" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(RuntimeError, match="not built"):
        native.NativePipeline(state)


@pytest.mark.skipif(not native.available(), reason=f"native path not built: {native.IMPORT_ERROR}")
def test_native_is_the_default_when_built() -> None:
    state = build_state(load_p4info())
    ports = SwitchPorts(PortsConfig(bindings=()), state=state)
    try:
        assert ports.datapath == "native" and isinstance(ports._pipeline, native.NativePipeline)
        ports.set_state(build_state(load_p4info()))
        assert isinstance(ports._pipeline, native.NativePipeline)
    finally:
        ports.stop()
