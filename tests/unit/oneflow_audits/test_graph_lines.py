"""nn.Graph's conversions given the user's line: from an op's ``loc``, from a ``to_global`` the
graph's passes folded away, and one headline per new conversion (recorded data; no OneFlow)."""

from __future__ import annotations

from pytest_gpumem.oneflow import boxing
from pytest_gpumem.oneflow.boxing import Boxing

# OneFlow 0.9's ``op_conf.loc`` of a matmul built in a user's forward through nn.Linear
LOC = ("Python Stack[-3]: 'build' at '/repo/train.py': line 40; "
       "Python Stack[-2]: 'forward' at '/repo/model.py': line 25; "
       "Python Stack[-1]: 'forward' at '/venv/lib/python3.10/site-packages/oneflow/nn/modules/linear.py': "
       "line 131;  ... more")


def test_the_innermost_user_frame_of_an_ops_loc_is_its_line(tmp_path):
    from pathlib import Path

    assert boxing.loc_line(LOC, Path("/repo")) == "model.py:25 forward"
    only_oneflow = "Python Stack[-1]: 'forward' at '/venv/lib/python3.10/site-packages/oneflow/nn/x.py': line 9; "
    assert boxing.loc_line(only_oneflow) == ""
    assert boxing.loc_line("") == ""


def test_a_folded_to_global_gives_its_line_back():
    found = [Boxing("S(0)", "B", "m-relu-2 (relu)", "m-matmul-0/out_0 (2048, 1024) float32", line="model.py:19 f"),
             Boxing("S(0)", "B", "m-mm-3 (matmul)", "m-add_n-1/out_0 (256, 256) float32", line="model.py:17 f")]
    lines = [b.line for b in boxing.with_cast_lines(found, [("S(0)", "B", (2048, 1024), "model.py:21 forward")])]
    assert lines == ["model.py:21 forward", "model.py:17 f"]


def test_headlines_name_the_line_and_leave_data_parallelism_out():
    found = [
        Boxing("S(0)", "B", "m-relu-2 (relu)", "m-matmul-0/out_0 (8192, 1024) float32", line="model.py:21 forward"),
        Boxing("P", "B", "w_opt (sgd_update)", "g/out (1024, 1024) float32"),
        Boxing("B", "B", "w_opt (sgd_update)", "lr/out (1,) float32", "cpu:0 -> cpu:0-1"),
    ]
    assert boxing.headlines(2, found, None, [(1, [])]) == [
        "S(0)->B at model.py:21 forward: 32.0 MiB moved at nproc=2 (nn.Graph, new against nproc=1)"]
    section = boxing.failure_lines(2, found, None, [(1, [])])
    assert not any("P->B" in line for line in section), section
    # against a baseline whose audit had no P->B, the all-reduce is news
    stored = {"boxing.graphs": "1", "boxing.S(0)->B": "1"}
    assert boxing.headlines(2, found, stored, []) == [
        "P->B at w_opt (sgd_update): 4.0 MiB moved at nproc=2 (nn.Graph, new against the baseline)"]


def test_a_graph_input_a_rank_holds_more_of_is_named_with_its_sizes():
    """The batch broadcast before the call: B at both sizes, but twice the rows a rank at nproc=2."""
    def item(name, sbp, rows, ranks):
        return {"name": name, "sbp": sbp, "tensor": f"({rows}, 256) float32", "ranks": ranks}

    one = [item("_Step_0_input.0.0", "S(0)", 4096, 1), item("_Step_2_input.0.0", "B", 4096, 1)]
    two = [item("_Step_0_input.0.0", "S(0)", 8192, 2), item("_Step_2_input.0.0", "B", 8192, 2)]
    assert boxing.input_lines(2, two, 1, one) == [
        "graph input _Step_2_input.0.0 (8192, 256) float32: B, 8.0 MiB a rank at nproc=2 (B, 4.0 MiB at nproc=1)"]
    assert boxing.input_lines(2, two, 2, two) == []
