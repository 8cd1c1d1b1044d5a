"""The shell tools' exit status: ``tools/slurm/install`` succeeds on a machine without Slurm whether or
not the image already ships ``/usr/sbin/policy-rc.d`` (issue 27: under set -e its EXIT trap turned a
finished install into exit status 1 where the file existed, so `make test-slurm` failed on its
first run in a fresh Debian container).

The real script runs with a PATH of stubs alone (apt-get, dpkg-query, id saying root; chmod and rm
the real ones), so no Slurm tool is found whatever this machine has, nothing is installed, and the
policy file is one in tmp_path (``GPUMEM_POLICY_RC_D``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED_POLICY = "#!/bin/sh\n# the image's own\nexit 101\n"


def stubs(folder: Path) -> Path:
    folder.mkdir()
    scripts = {
        # what apt-get saw: its arguments and the policy file's content at that moment
        "apt-get": '#!/bin/sh\necho "apt-get $* | policy: $(cat "$GPUMEM_POLICY_RC_D" 2>/dev/null | tail -n 1)" '
                   '>> "$STUB_LOG"\n',
        "dpkg-query": "#!/bin/sh\nprintf 22.05.8-4\n",
        "id": "#!/bin/sh\necho 0\n",
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    for tool in ("chmod", "rm", "cat", "tail"):
        found = shutil.which(tool)
        assert found is not None, tool
        (folder / tool).symlink_to(found)
    return folder


@pytest.mark.parametrize("shipped", [True, False], ids=["policy-rc.d-present", "policy-rc.d-absent"])
def test_slurm_install_succeeds_with_or_without_an_existing_policy_rc_d(tmp_path: Path, shipped: bool):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    policy, log = tmp_path / "policy-rc.d", tmp_path / "stub.log"
    if shipped:
        policy.write_text(SHIPPED_POLICY)
    env = {"PATH": str(stubs(tmp_path / "bin")), "GPUMEM_POLICY_RC_D": str(policy), "STUB_LOG": str(log),
           "HOME": os.environ.get("HOME", str(tmp_path))}
    done = subprocess.run([bash, str(REPO / "tools/slurm/install")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "slurm-install: installed slurmctld slurmd slurm-client munge (22.05.8-4)" in done.stderr
    calls = log.read_text().splitlines()
    assert [c.split(" | ")[0] for c in calls] == [
        "apt-get update -qq", "apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge"]
    assert all(c.endswith("policy: exit 101") for c in calls), "no package may start its daemons"
    if shipped:
        assert policy.read_text() == SHIPPED_POLICY, "the image's own file is left as it was"
    else:
        assert not policy.exists(), "the file the script added is removed again"
