"""Values a simulated rank would receive from other ranks: a mixture-of-experts job whose buffers are
sized by token counts an all_to_all_single brings (tests/jobs.py TORCH_MOE), on real gloo ranks.

Without a declared assumption the simulated rank stops at the job's own line that reads the counts;
under ``assume="alike"`` it reads rank 0's figure of the real world, and a collapsed router (every
token to expert 0) fails its ratio as it does for real."""

from __future__ import annotations

import json

import pytest
from jobs import TORCH_MOE, moe_expert_lines

from conftest import GLOO_TRANSIENT_MIB  # gloo's own buffers, which a simulated rank has none of

# Imported before pytester's first snapshot of sys.modules (see test_reference.py).
pytest.importorskip("torch")

MARGIN_MIB = 1.0  # real - simulated: host figures rerun within 0.4 MiB (simulate_validation.txt)


def both(router: str) -> str:
    return "".join(f'''
@pytest.mark.gpumem(nproc=[1, 4], device="cpu", max_ratio=1.1, simulate="{mode}", assume="alike")
def test_{router}_{"real" if mode == "off" else "simulated"}():
    moe_job("{router}")
''' for mode in ("off", "on"))


@pytest.mark.torch
@pytest.mark.slow
def test_moe_routing_under_the_alike_assumption_reads_the_real_figure_and_a_collapsed_router_fails(
        pytester, launch_tag, tmp_path):
    pytester.makepyfile(test_moe=TORCH_MOE + both("balanced") + both("collapsed"))
    report = tmp_path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "ignore",
                                f"--gpumem-report={report}")
    sizes = {t["test"].split("::")[1]: t["sizes"][-1] for t in json.loads(report.read_text())["tests"]}
    for name, size in sizes.items():
        print(f"{name} nproc=4: {size['gated_mib']:.2f} MiB, ratio {size['ratio']:.3f}")
    result.assert_outcomes(passed=2, failed=2)
    for router in ("balanced", "collapsed"):
        real, simulated = sizes[f"test_{router}_real"], sizes[f"test_{router}_simulated"]
        assert simulated["simulated"] == [0] and real["simulated"] == []  # assume=: the gated rank alone
        assert -MARGIN_MIB <= real["gated_mib"] - simulated["gated_mib"] <= MARGIN_MIB + GLOO_TRANSIENT_MIB
    assert sizes["test_balanced_simulated"]["ratio"] <= 1.1 < sizes["test_collapsed_simulated"]["ratio"]
    result.stdout.fnmatch_lines(["*simulated world: values received from other ranks (all_to_all_single) read at "
                                 "test_moe.py:*, taken as alike*"])
    # The failure leads with the line whose buffer the received counts sized, grown since nproc=1.
    lines = result.stdout.lines
    heading = next(i for i, line in enumerate(lines) if line.startswith("gpumem: ") and "nproc=4" in line)
    assert lines[heading + 1] == "  peak sites that grew since nproc=1 (rank 0, nproc=4):", lines[heading:heading + 3]
    assert lines[heading + 2].split()[2] in moe_expert_lines(), lines[heading:heading + 3]


@pytest.mark.torch
@pytest.mark.slow
def test_without_an_assumption_a_simulated_rank_stops_at_the_line_that_reads_what_others_send(pytester,
                                                                                             launch_tag):
    pytester.makepyfile(test_moe=TORCH_MOE + '''
@pytest.mark.gpumem(nproc=2, device="cpu", simulate="on")
def test_moe():
    moe_job()
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "ignore")
    result.assert_outcomes(failed=1)
    line = next(n for n, text in enumerate(TORCH_MOE.lstrip("\n").splitlines(), 1) if ".tolist()" in text)
    result.stdout.fnmatch_lines([f"*tolist() at test_moe.py:{line} reads values that other ranks send "
                                 "(all_to_all_single), in rank 0 of a simulated world of 2*assume='alike'*"])


# Rank 1 of a simulated world of 4 under assume="alike", in a process of its own (the stand-in patches
# torch for the process's life): what each collective leaves in an integer tensor, as the assumption
# says every rank sends what this one sends.
FILLS = '''
import os, sys
os.environ.update(GPUMEM_SIMULATED_RANK="1/4", GPUMEM_SIMULATE_ASSUME=sys.argv[1], MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="1", RANK="1", WORLD_SIZE="4")
from pytest_gpumem.rankside import simulate
simulate.install_world(simulate.world())
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
counts = torch.tensor([3, 5, 7, 9])
summed = counts.clone(); dist.all_reduce(summed)
largest = counts.clone(); dist.all_reduce(largest, op=dist.ReduceOp.MAX)
gathered = torch.empty(8, dtype=torch.int64); dist.all_gather_into_tensor(gathered, counts[:2])
received = torch.empty(4, dtype=torch.int64); dist.all_to_all_single(received, counts)
uneven = torch.empty(8, dtype=torch.int64); dist.all_to_all_single(uneven, torch.arange(10), [2] * 4, [1, 2, 3, 4])
scattered = torch.empty(1, dtype=torch.int64); dist.reduce_scatter_tensor(scattered, counts)
floats = torch.zeros(4); dist.all_reduce(floats)
from torch.distributed import _functional_collectives as funcol
functional = funcol.all_to_all_single(counts, None, None, dist.group.WORLD)
keywords = torch.empty(8, dtype=torch.int64)  # by torch's own names, as DeepSpeed calls it
dist.all_gather_into_tensor(output_tensor=keywords, input_tensor=counts[:2])
print(summed.tolist(), largest.tolist(), gathered.tolist(), received.tolist(), uneven.tolist(),
      scattered.tolist(), floats.tolist(), (summed.sum() + 1).tolist(), simulate.notes[-1], functional.tolist(),
      keywords.tolist(), sep="|")
'''


@pytest.mark.torch
def test_under_alike_each_collective_leaves_what_n_ranks_like_this_one_would_send(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FILLS, "alike"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()[-1].split("|")
    assert out[:8] == [
        "[12, 20, 28, 36]",          # a sum over 4 alike ranks
        "[3, 5, 7, 9]",              # a max over them: this rank's
        "[3, 5, 3, 5, 3, 5, 3, 5]",  # each rank's part: this rank's
        "[5, 5, 5, 5]",              # from each rank, what this rank (rank 1) sends rank 1
        "[1, 2, 1, 2, 1, 2, 1, 2]",  # uneven splits: this rank's second split, from every rank
        "[20]",                      # reduce-scatter: this rank's chunk, summed over 4
        "[0.0, 0.0, 0.0, 0.0]",      # floating tensors are data: left as the fake group leaves them
        "97",                        # computed from a received tensor: followed, and read under the assumption
    ]
    assert out[8].startswith("values received from other ranks (all_reduce) read at <string>:")
    assert out[8].endswith("taken as alike: every rank sends what this rank sends")
    assert out[9] == "[5, 5, 5, 5]"  # the functional all_to_all_single, as the in-place one
    assert out[10] == "[3, 5, 3, 5, 3, 5, 3, 5]"  # arguments given by keyword: filled as given by place


@pytest.mark.torch
def test_without_an_assumption_reading_a_received_count_stops_the_rank_naming_the_read(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FILLS, ""], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("ReceivedValueError: tolist() at <string>:" in proc.stderr
            and "reads values that other ranks send (all_reduce), in rank 1 of a simulated world of 4" in proc.stderr)
