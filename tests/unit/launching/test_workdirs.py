"""Launch folders are named after their owner; a folder whose owner is gone is swept, others stay."""

from __future__ import annotations

import os
import subprocess
import sys

from pytest_gpumem.launching.workdirs import PREFIX, make_workdir, sweep_orphans


def test_folder_of_a_dead_owner_is_swept_and_a_live_one_kept(tmp_path):
    mine = make_workdir(tmp_path)
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    child = subprocess.run([sys.executable, "-c",
                            "import sys; from pathlib import Path; "
                            "from pytest_gpumem.launching.workdirs import make_workdir;"
                            "d = make_workdir(Path(sys.argv[1])); (d / 'rank-0.log').write_text('x'); print(d)",
                            str(tmp_path)], capture_output=True, text=True, check=True)
    orphan = tmp_path / os.path.basename(child.stdout.strip())
    assert orphan.is_dir()
    unrelated = tmp_path / f"{PREFIX}not-a-launch"
    unrelated.mkdir()
    assert sweep_orphans(tmp_path) == [orphan]
    assert mine.is_dir() and unrelated.is_dir() and not orphan.exists()


def test_a_reused_pid_is_not_taken_for_the_owner(tmp_path):
    """Same pid as a live process, another start time: the owner is gone."""
    me = os.getpid()
    stale = tmp_path / f"{PREFIX}{me}-1-abcd"
    stale.mkdir()
    assert sweep_orphans(tmp_path) == [stale]
