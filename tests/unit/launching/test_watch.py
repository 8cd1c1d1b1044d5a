"""The lines a user sees while a test's sizes run (launching/watch.py)."""

from __future__ import annotations

from pathlib import Path

from pytest_gpumem.launching.watch import Follower, RunningLine, what


def test_a_size_says_whether_it_is_simulated_or_on_a_fake_gpu():
    assert what(4, (), None) == "nproc=4"
    assert what(8, (0,), None) == "nproc=8 (simulated: rank 0)"
    assert what(8, (0, 7), None) == "nproc=8 (simulated: ranks 0, 7)"
    assert what(2, (0,), "NVIDIA H200") == "nproc=2 (fake NVIDIA H200)"


def test_the_follower_says_each_line_once_and_the_unfinished_one_at_the_end(tmp_path: Path):
    log, said = tmp_path / "rank-0.log", []
    follower = Follower(log, said.append, "[rank 0] ")  # read by hand here, not by its thread
    follower._read()  # no file yet: nothing
    log.write_text("step 0\nstep 1\nhalf")
    follower._read()
    assert said == ["[rank 0] step 0", "[rank 0] step 1"]
    with log.open("a") as handle:
        handle.write(" a line\nlast, no newline")
    follower._read(final=True)
    assert said == ["[rank 0] step 0", "[rank 0] step 1", "[rank 0] half a line", "[rank 0] last, no newline"]


def test_the_follower_reads_while_the_launch_runs_and_stops_with_it(tmp_path: Path):
    log, said = tmp_path / "rank-0.log", []
    log.write_text("started\n")
    with Follower(log, said.append, ""):
        pass
    assert said == ["started"]


def test_the_running_line_shows_the_size_running_and_erases_it_in_place():
    written: list[str] = []
    line = RunningLine(written.append)
    line("gpumem nproc=8 (simulated: rank 0)")
    line("")
    screen, cursor = [], 0
    for text in written:  # what a terminal shows: a backspace moves the cursor back, a character overwrites
        for char in text:
            if char == "\b":
                cursor -= 1
                continue
            screen[cursor:cursor + 1] = [char]
            cursor += 1
    assert written[0] == " [gpumem nproc=8 (simulated: rank 0)]"
    assert "".join(screen).strip() == "" and cursor == 0  # blanked where it stood, the cursor back there
