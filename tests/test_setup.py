"""make setup is idempotent and says exactly what needs root."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_second_setup_does_nothing() -> None:
    result = subprocess.run(["make", "-s", "setup"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    again = subprocess.run(["make", "setup"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "pip install" not in again.stdout and "apt-get" not in again.stdout, again.stdout


@pytest.mark.root
def test_setup_without_root_names_the_packages_that_need_it() -> None:
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.skip("runuser is not installed")
    # A copy of the Makefile in a world-readable folder: the clone may sit under /root.
    folder = Path(tempfile.mkdtemp(prefix="cm-setup-"))
    try:
        folder.chmod(0o755)
        shutil.copy(REPO / "Makefile", folder / "Makefile")
        (folder / "Makefile").chmod(0o644)
        result = subprocess.run(
            [
                runuser,
                "-u",
                "nobody",
                "--",
                "make",
                "-s",
                "-C",
                str(folder),
                "system-packages",
                "APT_PACKAGES=checkmate-no-such-package",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": "/tmp"},
        )
    finally:
        shutil.rmtree(folder)
    assert result.returncode != 0
    assert "needs root" in result.stdout and "checkmate-no-such-package" in result.stdout


def test_make_p4_says_when_p4c_is_missing() -> None:
    if shutil.which("p4c"):
        pytest.skip("p4c is installed; tests/test_p4_program.py compiles with it")
    result = subprocess.run(["make", "-s", "p4"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "p4c is not installed" in result.stdout
