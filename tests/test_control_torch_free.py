"""The control channel's messages, its status client and the controller import and work without torch.

Run in a fresh interpreter in which ``import torch`` fails: the controller (``checkmate-ctl``,
``job show`` asking shadows for status) must not need it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # any "import torch" now raises ImportError
    import checkmate.control as control
    import controller.cli, controller.shadow_status, checkmate.p4.p4info
    report = control.StatusReport(7, {"state": "running", "applied_iteration": 41})
    assert control.decode_message(bytes(control.encode_message(report)[1])) == report
    commit = control.Commit(7, 3, [0.1], optimizer_step=3, data_position={"epoch": 1})
    assert control.decode_message(bytes(control.encode_message(commit)[1])) == commit
    try:
        control.torch_dtype("float32")
    except ImportError:
        print("tensors need torch")
    """
)


def test_control_messages_and_the_controller_import_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tensors need torch\n"
