"""The OneFlow boxing audit: real 2-rank nn.Graph jobs, a hand-made job proto, and the plain parts.

The tests that need OneFlow skip without it; the others (summarize/diff, the repr parser, the hook
without OneFlow or with a stand-in) run in any venv.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pytest_gpumem.oneflow import boxing
from pytest_gpumem.oneflow.boxing import Boxing, diff, summarize

pytestmark = pytest.mark.oneflow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def flow():
    return pytest.importorskip("oneflow")


# --------------------------------------------------------------------------- plain data

def test_summarize_counts_by_kind_and_accepts_json_records():
    found = [
        Boxing("P", "B", "m.weight_optimizer (sgd_update)", "m-matmul-21/out_0 (4, 8) float32"),
        Boxing("P", "B", "m.bias_optimizer (sgd_update)", "m-reduce_sum_like-20/y_0 (4,) float32"),
        Boxing("P", "S(0)", "add_n-1 (add_n)", "matmul-0/out_0 (8, 8) float32"),
        Boxing("B", "B", "lr (identity)", "lr/out (1,) float32", "cpu:0 -> cpu:0-1"),
        Boxing("(P, S(0))", "(B, S(0))", "x (matmul)", "y/out_0 (8, 8) float16"),
    ]
    expected = {"(P, S(0))->(B, S(0))": 1, "B->B [cpu:0 -> cpu:0-1]": 1, "P->B": 2, "P->S(0)": 1}
    assert summarize(found) == expected
    assert list(summarize(found)) == sorted(expected)
    as_json = json.loads(json.dumps([b.__dict__ for b in found]))
    assert summarize(as_json) == expected
    assert summarize([]) == {}
    assert str(found[2]) == "P->S(0): matmul-0/out_0 (8, 8) float32 into add_n-1 (add_n)"


def test_diff_puts_new_conversions_first():
    old = {"P->B": 4, "S(0)->B": 1, "S(0)->S(1)": 2, "B->B [cpu:0 -> cpu:0-1]": 1}
    new = {"P->B": 6, "P->S(0)": 2, "S(1)->B": 1, "S(0)->S(1)": 1, "B->B [cpu:0 -> cpu:0-1]": 1}
    assert diff(old, new) == [
        "new: P->S(0) x2 (was 0)",
        "new: S(1)->B x1 (was 0)",
        "more: P->B x6 (was 4)",
        "fewer: S(0)->S(1) x1 (was 2)",
        "gone: S(0)->B (was x1)",
    ]
    assert diff(new, new) == []
    assert diff({}, {"P->S(0)": 1}) == ["new: P->S(0) x1 (was 0)"]


def test_rank_provenance_round_trip_and_diff(tmp_path):
    path = tmp_path / "rank-0.boxing"
    assert boxing.rank_provenance(path) == {}  # no graph compiled: provenance unchanged
    p_to_b = {"src": "P", "dst": "B", "op": "w_opt (sgd_update)", "tensor": "mm/out_0 (4, 8) float32", "placement": ""}
    p_to_s = dict(p_to_b, dst="S(0)", op="add_n-1 (add_n)")
    path.write_text(json.dumps({"graph": "G_0", "boxings": [p_to_b, p_to_b]}) + "\n"
                    + json.dumps({"graph": "G_1", "error": "ValueError: boom"}) + "\n" + "{broken\n")
    old = boxing.rank_provenance(path)
    assert old == {"boxing.graphs": "2", "boxing.P->B": "2", "boxing.error": "G_1: ValueError: boom"}
    assert all(isinstance(v, str) for v in old.values())  # the baseline's provenance is flat strings
    path.write_text(json.dumps({"graph": "G_0", "boxings": [p_to_b, p_to_b, p_to_s]}) + "\n")
    new = boxing.rank_provenance(path)
    assert boxing.from_provenance(new) == {"P->B": 2, "P->S(0)": 1}
    assert boxing.diff(boxing.from_provenance(old) or {}, boxing.from_provenance(new) or {}) == [
        "new: P->S(0) x1 (was 0)"]
    assert boxing.from_provenance({"oneflow": "0.9.0"}) is None  # a baseline from before the audit
    records = boxing.read_records(path)
    assert boxing.explain(boxing.from_provenance(old), records[0]["boxings"]) == [
        "new: P->S(0) x1 (was 0); 128 B moved", "  128 B  mm/out_0 (4, 8) float32 into add_n-1 (add_n)"]
    assert boxing.explain({}, [p_to_b] * 5, limit=2) == [
        "new: P->B x5 (was 0); 640 B moved", "  128 B  mm/out_0 (4, 8) float32 into w_opt (sgd_update)",
        "  128 B  mm/out_0 (4, 8) float32 into w_opt (sgd_update)", "  ... and 3 more"]


def test_tensor_bytes_from_shape_and_dtype():
    assert boxing.tensor_bytes("in/out (2048, 16384) float32") == 2048 * 16384 * 4
    assert boxing.tensor_bytes("y/out (2048,) int64") == 2048 * 8
    assert boxing.tensor_bytes("loss/out () float32") == 4  # a scalar
    assert boxing.tensor_bytes("h/out (8, 8) bfloat16") == 128
    assert boxing.tensor_bytes("w/out (8, 8) dtype#99") is None  # unknown dtype: no guess
    assert boxing.tensor_bytes("some_blob") is None
    assert [boxing.format_bytes(n) for n in (None, 12, 2048, 128 << 20, 3 << 30)] == [
        "size n/a", "12 B", "2.0 KiB", "128.0 MiB", "3.0 GiB"]


def _b(src, dst, tensor, op="op (t)", placement=""):
    return Boxing(src, dst, op, tensor, placement)


def test_explain_puts_the_biggest_new_conversion_first_and_folds_tiny_moves():
    lr = "cpu:0 -> cpu:0-1"
    found = [
        _b("P", "S(0)", "mm/out_0 (8, 8) float32", "add_n-1 (add_n)"),            # new, 256 B
        _b("S(0)", "B", "in.1/out (2048,) int64", "cast-1 (cast)"),                # new kind, 16 KiB ...
        _b("S(0)", "B", "in.0/out (2048, 16384) float32", "cast-0 (cast)"),        # ... and 128 MiB
        _b("B", "B", "lr/out (1,) float32", "w_opt (sgd_update)", lr),              # LR scalar to every rank
        _b("B", "B", "step/out (1,) int64", "b_opt (sgd_update)", lr),
        _b("B", "B", "w/out (4096, 4096) float32", "w_copy (copy)", "cpu:0 -> cpu:1"),  # big: not folded
        _b("P", "B", "g/out (64,) float32", "g_opt (sgd_update)"),
        _b("P", "B", "big/out (1024, 1024) float32", "big_opt (sgd_update)"),
    ]
    lines = boxing.explain({"P->B": 1, "S(1)->B": 2}, found)
    assert lines == [
        "new: S(0)->B x2 (was 0); 128.0 MiB moved",
        "  128.0 MiB  in.0/out (2048, 16384) float32 into cast-0 (cast)",
        "  16.0 KiB  in.1/out (2048,) int64 into cast-1 (cast)",
        "new: B->B [cpu:0 -> cpu:1] x1 (was 0); 64.0 MiB moved",
        "  64.0 MiB  w/out (4096, 4096) float32 into w_copy (copy)",
        "new: P->S(0) x1 (was 0); 256 B moved",
        "  256 B  mm/out_0 (8, 8) float32 into add_n-1 (add_n)",
        "more: P->B x2 (was 1); 4.0 MiB moved",
        "  4.0 MiB  big/out (1024, 1024) float32 into big_opt (sgd_update)",
        "  256 B  g/out (64,) float32 into g_opt (sgd_update)",
        "gone: S(1)->B (was x2)",
        "also 2 placement-only moves of tiny tensors (< 64.0 KiB): B->B [cpu:0 -> cpu:0-1] x2 (was 0)",
    ]
    # The same conversions in another order explain the same way.
    assert boxing.explain({"P->B": 1, "S(1)->B": 2}, list(reversed(found))) == lines
    # Nothing changed: nothing to say, tiny moves included.
    assert boxing.explain(summarize(found), found) == []


# OneFlow 0.9's print(graph) after the first call (abridged from a 2-rank run of the (b) graph below):
# one string per printed line, a long line's continuations indented further.
REPR_0_9 = (
    "(GRAPH:TrainGraph_1:TrainGraph): (\n"
    "    (GraphModule:m()): (\n"
    "      (OPERATOR: m.mix() -> (out:sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32)), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0])))\n"
    "      (OPERATOR: m-matmul-0(_TrainGraph_1_input.0.0_2/out:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32)), "
        "_TrainGraph_1_input.0.0_2/out:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32))) "
        "-> (m-matmul-0/out_0:(sbp=(P), size=(8, 8), dtype=(oneflow.float32))), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0, 1])))\n"
    "      (OPERATOR: m-add_n-1([m-matmul-0/out_0:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32)), "
        "m.mix/out:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32))]) "
        "-> (m-add_n-1/out_0:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32))), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0, 1])))\n"
    "      (OPERATOR: m-matmul-2(_TrainGraph_1_input.0.0_2/out:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32)), "
        "m-add_n-1/out_0:(sbp=(B), size=(8, 8), dtype=(oneflow.float32))) "
        "-> (m-matmul-2/out_0:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32))), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0, 1])))\n"
    "    )\n"
    "  (OPERATOR: _TrainGraph_1_input.0.0_2() "
        "-> (_TrainGraph_1_input.0.0_2/out:sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32)), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0, 1])))\n"
    "  (OPERATOR: reduce_sum-8(nll-5/out_weight_0:(sbp=(S(0)), size=(8), dtype=(oneflow.float32))) "
        "-> (reduce_sum-8/output_tensor_0:(sbp=(P), size=(), dtype=(oneflow.float32))), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0, 1])))\n"
    "  (OPERATOR: Sys-Boxing-GroupIdentity-reduce_sum-8_output_tensor_0-36(reduce_sum-8/output_tensor_0:sbp=(B), "
        "size=(), dtype=(oneflow.float32)) -> (out:sbp=(B), size=(), dtype=(oneflow.float32)), "
        "placement=(oneflow.placement(type=\"cpu\", ranks=[0, 1])))\n"
    ")\n"
)


def test_audit_repr_reads_the_printed_graph():
    found = boxing.audit_repr(REPR_0_9)
    assert [str(b) for b in found] == [
        "P->S(0): m-matmul-0/out_0 (8, 8) float32 into m-add_n-1",
        "S(0)->B: m-add_n-1/out_0 (8, 8) float32 into m-matmul-2",
        "P->B: reduce_sum-8/output_tensor_0 () float32 into Sys-Boxing-GroupIdentity-reduce_sum-8_output_tensor_0-36",
    ]
    # OneFlow 0.8 wrote ":placement=" and "..." for ops it could not print.
    v08 = ("(OPERATOR: mm(x/out:(sbp=(S(0)), size=(8, 8), dtype=(oneflow.float32))) -> "
           "(mm/out_0:(sbp=(P), size=(8, 8), dtype=(oneflow.float32)))"
           ":placement=(oneflow.placement(type=\"cuda\", ranks=[0, 1])))\n"
           "(OPERATOR: out(...) -> (...):placement=(oneflow.placement(type=\"cuda\", ranks=[0, 1])))\n"
           "(OPERATOR: add(mm/out_0:(sbp=(S(1)), size=(8, 8), dtype=(oneflow.float16))) -> "
           "(add/out_0:(sbp=(S(1)), size=(8, 8), dtype=(oneflow.float16)))"
           ":placement=(oneflow.placement(type=\"cuda\", ranks=[0, 1])))")
    assert [b.kind for b in boxing.audit_repr(v08)] == ["P->S(1)"]
    with pytest.raises(ValueError, match="no operator lines"):
        boxing.audit_repr("(GRAPH:G_0:G): ()")


# --------------------------------------------------------------------------- the hook, no OneFlow

def _run_python(code: str, cwd: Path, extra_path: Path | None = None, timeout: float = 60) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(p) for p in (extra_path, REPO) if p] + [os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_hook_writes_nothing_and_imports_nothing_when_oneflow_is_never_imported(tmp_path):
    out = _run_python(f"""
        import sys, json
        from pathlib import Path
        from pytest_gpumem.oneflow.boxing import install_graph_hook
        install_graph_hook(Path({str(tmp_path / 'rank-0.boxing')!r}))
        import json, email.message                                  # other imports go through untouched
        print("oneflow" in sys.modules)
    """, tmp_path)
    assert out.strip() == "False"
    assert list(tmp_path.iterdir()) == []


FAKE_ONEFLOW = '''
class Graph:
    """Stands in for oneflow.nn.Graph: no proto, so the audit reads the repr."""
    count = 0
    def __init__(self, broken=False):
        self.name, self.broken = f"Fake_{Graph.count}", broken
        Graph.count += 1
    def __call__(self, x):
        return x * 2
    def __repr__(self):
        if self.broken:
            raise RuntimeError("no repr")
        return ("(OPERATOR: g(w/out:(sbp=(B), size=(2), dtype=(oneflow.float32))) "
                "-> (g/out_0:(sbp=(P), size=(2), dtype=(oneflow.float32))), placement=(x))\\n"
                "(OPERATOR: opt(g/out_0:(sbp=(B), size=(2), dtype=(oneflow.float32))) -> (), placement=(x))")

class nn:
    Graph = Graph
'''


def test_hook_records_each_graph_once_and_never_changes_or_breaks_a_call(tmp_path):
    fake = tmp_path / "fake"
    (fake / "oneflow").mkdir(parents=True)
    (fake / "oneflow" / "__init__.py").write_text(FAKE_ONEFLOW)
    record = tmp_path / "rank-0.boxing"
    out = _run_python(f"""
        from pathlib import Path
        from pytest_gpumem.oneflow import boxing
        boxing.install_graph_hook(Path({str(record)!r}))    # before oneflow is imported
        audits = []
        real = boxing.graph_record
        boxing.graph_record = lambda g, *more: audits.append(g.name) or real(g, *more)
        import oneflow as flow
        good, broken = flow.nn.Graph(), flow.nn.Graph(broken=True)
        results = [good(1), good(2), good(3), broken(4), broken(5)]
        print(results, audits)
        boxing.install_graph_hook(Path({str(record)!r}))    # twice: still one wrapper
        print(flow.nn.Graph()(6), audits)
    """, tmp_path, extra_path=fake)
    assert out.splitlines() == ["[2, 4, 6, 8, 10] ['Fake_0', 'Fake_1']", "12 ['Fake_0', 'Fake_1', 'Fake_2']"]
    records = boxing.read_records(record)
    assert [r["graph"] for r in records] == ["Fake_0", "Fake_1", "Fake_2"]
    assert summarize(records[0]["boxings"]) == {"P->B": 1}
    assert "no repr" in records[1]["error"] and "boxings" not in records[1]
    assert boxing.summarize_records(records) == {"P->B": 2}


# --------------------------------------------------------------------------- a hand-made job proto

def _job(flow):
    """Three ranks of a 2-D (2, 2) placement on cuda, an explicit NCCL all-reduce op, a move to one rank."""
    from oneflow.core.job import job_pb2

    job = job_pb2.Job()

    def sbp(nd, text):
        for part in text:
            s = nd.sbp_parallel.add()
            if part == "B":
                s.broadcast_parallel.SetInParent()
            elif part == "P":
                s.partial_sum_parallel.SetInParent()
            else:
                s.split_parallel.axis = int(part[2])

    def op(name, op_type, ins, outs, conf="user_conf"):
        o = job.net.op.add()
        o.name = name
        if conf == "user_conf":
            o.user_conf.op_type_name = op_type
        else:
            getattr(o, conf).SetInParent()
        args = job.helper.op_name2arg_signature[name].bn_in_op2lbi
        sigs = job.job_parallel_view_conf.op_name2nd_sbp_signature_conf[name].bn_in_op2nd_sbp
        for bn, lbn, nd in ins:
            args[bn].op_name, args[bn].blob_name = lbn.split("/")
            sbp(sigs[bn], nd)
        for bn, nd in outs:
            args[bn].op_name, args[bn].blob_name = name, bn
            sbp(sigs[bn], nd)
            desc = job.helper.lbn2logical_blob_desc[f"{name}/{bn}"]
            desc.shape.dim.extend([8, 4])
            desc.data_type = 2  # kFloat

    op("mm", "matmul", [], [("out_0", ("S(0)", "P"))])
    op("ar", "_nccl_logical_2D_same_dim1_all_reduce", [("in_0", "mm/out_0", ("S(0)", "P"))],
       [("out_0", ("S(0)", "B"))])
    op("relu", "relu", [("x_0", "ar/out_0", ("S(0)", "B"))], [("y_0", ("S(0)", "B"))])
    op("gather", "identity", [("in_0", "relu/y_0", ("B", "B"))], [("out_0", ("B", "B"))])
    op("to_rank0", "identity", [("in_0", "gather/out_0", ("B",))], [("out_0", ("B",))])
    op("tick", "", [("in_0", "to_rank0/out_0", ("B",))], [("out", ("B",))], conf="device_tick_conf")
    for names, devices, dims in ((["mm", "ar", "relu", "gather"], ["@0:0", "@1:0", "@2:0", "@3:0"], [2, 2]),
                                 (["to_rank0", "tick"], ["@0:0"], [1])):
        group = job.placement.placement_group.add()
        group.op_set.op_name.extend(names)
        group.parallel_conf.device_tag = "cuda"
        group.parallel_conf.device_name.extend(devices)
        group.parallel_conf.hierarchy.dim.extend(dims)
    return job


def test_audit_job_on_a_hand_made_proto(flow):
    found = boxing.audit_job(_job(flow))
    assert [str(b) for b in found] == [
        "(S(0), P)->(S(0), B): mm/out_0 (8, 4) float32 into ar (_nccl_logical_2D_same_dim1_all_reduce)",
        "(S(0), B)->(B, B): relu/y_0 (8, 4) float32 into gather (identity)",
        "(B, B)->B [cuda:0-3 (2, 2) -> cuda:0]: gather/out_0 (8, 4) float32 into to_rank0 (identity)",
    ]


# --------------------------------------------------------------------------- real 2-rank graphs

WORKLOAD = '''
import json, os, sys
from dataclasses import asdict
from pathlib import Path

from pytest_gpumem.oneflow import boxing

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
boxing.install_graph_hook(out / f"rank-{rank}.boxing")   # as rank.py would, before any import
assert "oneflow" not in sys.modules

import numpy as np
import oneflow as flow

F, C, N = 8, 4, 4
world = flow.env.get_world_size()
placement = flow.placement("cpu", ranks=list(range(world)))
S0, B = flow.sbp.split(0), flow.sbp.broadcast


class Model(flow.nn.Module):
    def __init__(self, mix):
        super().__init__()
        self.lin = flow.nn.Linear(F, C)
        self.mix = flow.nn.Parameter(flow.zeros(F, F)) if mix else None

    def forward(self, x):
        if self.mix is not None:
            # x.T @ x over the split batch is a partial sum (P); adding a parameter split S(0)
            # forces a P -> S(0) reduce-scatter (and an S(0) -> B all-gather for the next matmul).
            x = x + flow.matmul(x, flow.matmul(x, x, transpose_a=True) + self.mix)
        return self.lin(x)


class TrainGraph(flow.nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = flow.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def train(variant, hooked=True):
    # Weights and batch from numpy, not OneFlow's generators: global random ops run asynchronously
    # and did not always draw the same values for the same seed, which would make "changes nothing"
    # compare two different computations.
    values = np.random.RandomState(0)
    model = Model(mix=variant == "b")
    model.lin.weight = flow.nn.Parameter(flow.tensor(values.standard_normal((C, F)), dtype=flow.float32))
    model.lin.bias = flow.nn.Parameter(flow.tensor(values.standard_normal(C), dtype=flow.float32))
    model = model.to_global(placement=placement, sbp=B)
    if variant == "b":
        model.mix = flow.nn.Parameter(flow.zeros(F, F, placement=placement, sbp=S0))
    graph = TrainGraph(model, flow.optim.SGD(model.parameters(), lr=0.1))
    call = graph if hooked else lambda *a: type(graph).__call__.__wrapped__(graph, *a)  # around the hook
    rows = slice(rank * N, (rank + 1) * N)  # this rank's shard of the global batch
    x = flow.tensor(values.standard_normal((N * world, F))[rows], dtype=flow.float32)
    y = flow.tensor(values.randint(0, C, N * world)[rows], dtype=flow.int64)
    x, y = x.to_global(placement=placement, sbp=S0), y.to_global(placement=placement, sbp=S0)
    losses = [float(call(x, y).to_global(sbp=B).to_local().numpy()) for _ in range(3)]
    return graph, losses


results = {}
for variant in ("a", "b"):
    graph, losses = train(variant)
    results[variant] = {
        "graph": graph.name,
        "losses": losses,
        "proto": [asdict(b) for b in boxing.audit_graph(graph)],
        "repr": [asdict(b) for b in boxing.audit_repr(repr(graph))],
    }
results["a_unhooked_losses"] = train("a", hooked=False)[1]
(out / f"rank-{rank}.json").write_text(json.dumps(results))
'''


def launch_two_ranks(script: Path, out: Path, timeout: float = 90) -> dict[int, dict]:
    """Two ranks with the launchers' env contract, each in its own session; killed at ``timeout``."""
    from pytest_gpumem.launching.supervise import free_port, oneflow_library_dirs

    out.mkdir()
    port, world = free_port(), 2
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GPUMEM_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               LD_LIBRARY_PATH=os.pathsep.join(oneflow_library_dirs() + [env.get("LD_LIBRARY_PATH", "")]))
    procs = []
    for rank in range(world):
        log = open(out / f"rank-{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(out)], cwd=out, stdout=log, stderr=subprocess.STDOUT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, start_new_session=True))
        log.close()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = "\n".join((out / f"rank-{r}.log").read_text()[-3000:] for r in range(world))
    assert [p.returncode for p in procs] == [0, 0], logs
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def two_rank_runs(flow, tmp_path_factory):
    """The workload, launched once on 2 ranks with the hook installed as rank.py would."""
    root = tmp_path_factory.mktemp("boxing")
    script = root / "workload.py"
    script.write_text(WORKLOAD)
    started = time.monotonic()
    ranks = launch_two_ranks(script, root / "out")
    return {"hooked": ranks, "dir": root / "out", "seconds": time.monotonic() - started}


def test_data_parallel_graph_boxes_only_its_gradients(two_rank_runs):
    """(a) batch S(0), parameters B: the P->B all-reduce of each gradient (and of the loss's scalars)."""
    found = [Boxing(**b) for b in two_rank_runs["hooked"][0]["a"]["proto"]]
    kinds = summarize(found)
    assert set(kinds) <= {"P->B", "B->B [cpu:0 -> cpu:0-1]"}, kinds  # the second: the LR, from rank 0 to all
    grads = {b.op.split()[0] for b in found if b.kind == "P->B"}
    assert {"model.lin.weight_optimizer", "model.lin.bias_optimizer"} <= grads, found


def test_an_op_that_forces_p_to_s_is_reported_and_named_first_by_diff(two_rank_runs):
    """(b) adds a parameter split S(0) to a partial sum: P->S(0) appears, and diff names it first."""
    run = two_rank_runs["hooked"][0]
    a = summarize(Boxing(**b) for b in run["a"]["proto"])
    found = [Boxing(**b) for b in run["b"]["proto"]]
    b = summarize(found)
    assert "P->S(0)" not in a and b["P->S(0)"] >= 1
    forward = [x for x in found if x.kind == "P->S(0)" and "add_n" in x.op]
    assert forward and forward[0].tensor.endswith("(8, 8) float32"), found
    lines = diff(a, b)
    assert lines[0].startswith("new: P->S(0) x"), lines
    explained = boxing.explain(a, found)
    assert explained[0].startswith(lines[0]) and "into model-add_n" in "".join(explained[1:4]), explained
    assert all(not line.startswith(("gone", "fewer")) for line in lines), lines


def test_the_proto_and_the_printed_graph_agree(two_rank_runs):
    """The repr fallback sees the same SBP conversions as the proto (it cannot see placement moves)."""
    for variant in ("a", "b"):
        run = two_rank_runs["hooked"][0][variant]
        proto = sorted((b["src"], b["dst"], b["tensor"]) for b in run["proto"] if not b["placement"])
        printed = sorted((b["src"], b["dst"], b["tensor"]) for b in run["repr"])
        assert proto == printed


def test_hook_records_each_graph_once_per_rank_and_changes_nothing(two_rank_runs):
    hooked = two_rank_runs["hooked"]
    for rank in (0, 1):
        records = boxing.read_records(two_rank_runs["dir"] / f"rank-{rank}.boxing")
        # graphs a and b, 3 calls each: one record each; the graph called around the hook: none
        assert [r["graph"] for r in records] == [hooked[rank][v]["graph"] for v in ("a", "b")], (rank, records)
        for record, variant in zip(records, ("a", "b")):
            assert record["boxings"] == hooked[rank][variant]["proto"], (rank, variant, record)
        assert hooked[rank]["a"]["losses"] == hooked[rank]["a_unhooked_losses"], rank
    for variant in ("a", "b"):  # one compiled job: every rank sees the same conversions (system op ids differ)
        assert summarize(hooked[0][variant]["proto"]) == summarize(hooked[1][variant]["proto"]), variant
    assert two_rank_runs["seconds"] < 60
