"""OneFlow nn.Graph data parallel: a healthy compiled training step, and one whose memory grows with the world size.

Rank-0 peak of live allocations (the gated host figure), OneFlow 0.9.0, pytest launched in each
rank by `python -m oneflow.distributed.launch`, MiB:

    test                              nproc=1            nproc=2
    test_oneflow_graph_dp             256.7 or 224.7     274.7 (1.07x or 1.22x)
    test_oneflow_graph_dp_inflated    320.8 or 288.8     580.0 (1.81x or 2.01x)

At nproc=1 the figure has two values 32.0 MiB apart: OneFlow's actor threads call OpenBLAS's sgemm,
and when two calls overlap OpenBLAS maps a second 32 MiB work buffer, which it keeps (each test read
the lower value in 5 of 16 reruns: benchmarks/results/oneflow_blas_buffer.txt, docs/host.md). So
these tests allow one buffer more than the examples' other tests: their baselines compare within
`max(2%, 40MiB)` (not 16), and their ratio gate is `max_ratio=1.2, allow_mib=48` (not 16). At
nproc=2 the limits are then 356 (or 318) and 433 (or 395) MiB, so the healthy test passes by ~81 (or
~43) MiB and the inflated one fails by ~147 (or ~185) MiB.

`print(graph)` after the first call shows the bug: the batch goes through a
`hierarchical_parallel_cast` to sbp B and every op after it runs on the whole global batch.

`EXAMPLE_BATCH_SBP=broadcast` plays the pull request that introduces the bug into the healthy test:
its committed baseline, its declared config and its boxing audit then explain the failure
(docs/getting-started.md, "A failing test's report").
"""
import os

import pytest

flow = pytest.importorskip("oneflow")

LOCAL_BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 1024, 16384, 64, 10, 3  # 64 MiB of batch per rank
# One OpenBLAS work buffer (32 MiB, mapped when two actor threads' sgemm calls overlap) more than the
# examples' other tests allow: 32 + 8 MiB against the baseline, 32 + 16 MiB over the ratio.
BLAS_BUFFER_TOLERANCE = "max(2%, 40MiB)"


class TrainGraph(flow.nn.Graph):
    def __init__(self, model, opt, broadcast_batch):
        super().__init__()
        self.model, self.broadcast_batch = model, broadcast_batch
        self.add_optimizer(opt)

    def build(self, x, y):
        if self.broadcast_batch:  # the bug: an S(0) -> B boxing all-gathers the global batch on every rank
            x = x.to_global(sbp=flow.sbp.broadcast)
            y = y.to_global(sbp=flow.sbp.broadcast)
        loss = flow.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()  # the compiler inserts the P -> B all-reduce of the parameter gradients
        return loss


def _train(broadcast_batch):
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    split, bcast = flow.sbp.split(0), flow.sbp.broadcast
    model = flow.nn.Sequential(
        flow.nn.Linear(FEATURES, HIDDEN), flow.nn.ReLU(), flow.nn.Linear(HIDDEN, CLASSES)
    ).to_global(placement=placement, sbp=bcast)
    graph = TrainGraph(model, flow.optim.SGD(model.parameters(), lr=0.01), broadcast_batch)
    # The global batch is split along dim 0: each rank materialises only its LOCAL_BATCH rows.
    x = flow.randn(LOCAL_BATCH * world, FEATURES, placement=placement, sbp=split)
    y = flow.randint(0, CLASSES, (LOCAL_BATCH * world,), placement=placement, sbp=split)
    for _ in range(STEPS):
        loss = graph(x, y)
    return loss.to_global(sbp=bcast).to_local().item()


@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2, allow_mib=48, launcher="oneflow",
                    tolerance=BLAS_BUFFER_TOLERANCE)
def test_oneflow_graph_dp(gpumem_config):
    """Healthy nn.Graph DP: each rank holds 1/world of the global batch, so its peak stays flat."""
    batch_sbp = os.environ.get("EXAMPLE_BATCH_SBP", "split")
    gpumem_config({"batch_sbp": batch_sbp, "local_batch": LOCAL_BATCH})
    assert _train(broadcast_batch=batch_sbp == "broadcast") > 0


@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2, allow_mib=48, launcher="oneflow",
                    tolerance=BLAS_BUFFER_TOLERANCE)
@pytest.mark.xfail(
    strict=True,
    reason="an S(0) -> B boxing of the batch inflates per-rank memory with the world size: the plugin must catch it",
)
def test_oneflow_graph_dp_inflated():
    """The graph boxes the batch S(0) -> B, so every rank materialises world_size x its share."""
    assert _train(broadcast_batch=True) > 0
