"""Do concurrent sessions lose rendezvous ports? Several ``pytest --gpumem -n 2`` sessions at once,
each over many short two-rank launches, repeated until a number of launches ran; counts the
launches that failed with EADDRINUSE and those the plugin relaunched on another port.

Each launch's body is a rendezvous as torch's TCPStore does it, without torch's start-up cost: rank 0
listens on MASTER_PORT (every address, SO_REUSEADDR), rank 1 connects (retrying until rank 0
listens) and they exchange a byte. ``--body torch`` runs ``init_process_group("gloo")`` and one
``all_reduce`` instead (seconds a launch). Ranks are forked (host tracking off) to keep launches
cheap on a small machine.

    python benchmarks/port_race.py --launches 1000 [--sessions 4] [--tests 25] [--body socket|torch]

``--plugin PATH`` runs the sessions with PATH first on PYTHONPATH (another checkout of the plugin,
e.g. one from before the port leases, to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOCKET_BODY = '''
def rendezvous():
    import socket

    port = int(os.environ["MASTER_PORT"])
    if os.environ["RANK"] == "0":
        with socket.socket() as server:  # as torch's TCPStore listens
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("", port))
            server.listen()
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(1))
        return
    end = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                client.sendall(b"x")
                assert client.recv(1) == b"x"
            return
        except ConnectionRefusedError:
            if time.monotonic() > end:
                raise
            time.sleep(0.01)
'''

TORCH_BODY = '''
def rendezvous():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    assert tensor[0].item() == 2
    dist.destroy_process_group()
'''

TEST_FILE = '''
import os
import time

import pytest
{body}

@pytest.mark.gpumem(nproc=2, timeout=60)
@pytest.mark.parametrize("n", range({tests}))
def test_launch(n):
    rendezvous()
'''

ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
RELAUNCHED = "was taken by another program before any rank's test body started"


def session_command(project: Path, index: int, round_: int) -> list[str]:
    return [sys.executable, "-m", "pytest", "--gpumem", "-n", "2", "-p", "no:cacheprovider", "-p", "no:randomly",
            "-q", "--gpumem-track-host=off", "--gpumem-start=fork", "--gpumem-floor=off",
            "--gpumem-missing-baseline=ignore", f"--gpumem-report={project}/report-{round_}-{index}.json",
            str(project / "test_launches.py")]


def run_round(project: Path, sessions: int, round_: int, env: dict[str, str]) -> list[tuple[str, list[dict]]]:
    procs = [subprocess.Popen(session_command(project, i, round_), cwd=project, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(sessions)]
    found = []
    for i, proc in enumerate(procs):
        out, _ = proc.communicate()
        report = project / f"report-{round_}-{i}.json"
        tests = json.loads(report.read_text())["tests"] if report.exists() else []
        found.append((out, tests))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--tests", type=int, default=25, help="two-rank launches per session and round")
    parser.add_argument("--body", choices=("socket", "torch"), default="socket")
    parser.add_argument("--plugin", help="a checkout of the plugin to put first on PYTHONPATH")
    parser.add_argument("--max-minutes", type=float, default=0, help="stop after the round that passes this")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if args.plugin:
        paths = [str(Path(args.plugin).resolve()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    launches = lost = relaunched = failed = rounds = 0
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpumem-port-race-") as tmp:
        project = Path(tmp)
        (project / "pytest.ini").write_text("[pytest]\n")
        body = SOCKET_BODY if args.body == "socket" else TORCH_BODY
        (project / "test_launches.py").write_text(TEST_FILE.format(body=body, tests=args.tests))
        while launches < args.launches:
            rounds += 1
            for out, tests in run_round(project, args.sessions, rounds, env):
                launches += len(tests)
                failed += sum(t.get("status") != "passed" for t in tests)
                lost += sum(bool(ADDRESS_IN_USE.search(line)) for line in out.splitlines()
                            if line.startswith("FAILED"))
                relaunched += sum(json.dumps(t).count(RELAUNCHED) for t in tests)  # the notes of the record
            minutes = (time.monotonic() - began) / 60
            print(f"round {rounds}: {launches} launches, {failed} failed, {lost} lost ports (EADDRINUSE), "
                  f"{relaunched} relaunched, {minutes:.1f} min", flush=True)
            if args.max_minutes and minutes > args.max_minutes:
                break
    print(f"command: {' '.join(session_command(Path('<project>'), 0, 0))} x {args.sessions} at once, "
          f"body={args.body}")
    print(f"launches: {launches}  failed: {failed}  lost ports (EADDRINUSE): {lost}  relaunched: {relaunched}  "
          f"wall: {(time.monotonic() - began) / 60:.1f} min")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
