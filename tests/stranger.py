"""Another local user of the node, for attacks that a local user makes (docs/security.md, the
threat model): the tests run as root in CI and make that user; its scripts run under the
system's own Python (stdlib only: the project's venv lives where that user cannot read).

    result = run_as_stranger(SCRIPT, {"port": 1234}, timeout_s=60)   # SCRIPT reads ARGS
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import textwrap

import pytest
from machine import unless_ci

STRANGER = "pdc-stranger"
SYSTEM_PYTHON = "/usr/bin/python3"
can_be_stranger = os.geteuid() == 0 and os.path.exists(SYSTEM_PYTHON) and shutil.which("useradd") is not None
needs_stranger = unless_ci(can_be_stranger, "attacks as another local user need root (to make that user) "
                                            "and /usr/bin/python3")


def stranger_uid() -> int:
    """The stranger's uid, the user made first if missing (root only)."""
    try:
        return pwd.getpwnam(STRANGER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", STRANGER],
                       check=True, capture_output=True)
        return pwd.getpwnam(STRANGER).pw_uid


def run_as_stranger(script: str, args: dict | None = None, timeout_s: float = 120) -> dict:
    """Run `script` (Python source; `ARGS` holds `args`) as the stranger, in /tmp; what it prints
    last as a JSON line is returned. Fails the test if the script fails."""
    return StrangerProcess(script, args).result(timeout_s)


class StrangerProcess:
    """`script` running as the stranger in the background (see run_as_stranger); `result()` waits
    for its end. Its first line `ready` (if it prints one) says it has set itself up: `ready()`."""

    def __init__(self, script: str, args: dict | None = None) -> None:
        uid = stranger_uid()
        source = f"import json, sys\nARGS = json.loads(sys.argv[1])\n{textwrap.dedent(script)}"
        self.process = subprocess.Popen([SYSTEM_PYTHON, "-c", source, json.dumps(args or {})], user=uid,
                                        group=pwd.getpwuid(uid).pw_gid, extra_groups=[], cwd="/tmp",
                                        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def tell(self, line: str) -> None:
        """A line on the script's stdin (a script that waits for one goes on)."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def ready(self, timeout_s: float = 30) -> None:
        """Until the script prints `ready` (its own first line)."""
        import select

        assert self.process.stdout is not None
        if not select.select([self.process.stdout], [], [], timeout_s)[0]:
            self.process.kill()
            pytest.fail("the stranger's script never said it was ready")
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.result(10)  # fails with its error output
            pytest.fail(f"the stranger's script said {line!r}, not 'ready'")

    def result(self, timeout_s: float = 120) -> dict:
        try:
            out, err = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            pytest.fail(f"the stranger's script ran past {timeout_s} s:\n{err[-3000:]}")
        if self.process.returncode != 0:
            pytest.fail(f"the stranger's script failed ({self.process.returncode}):\n{err[-3000:]}")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
