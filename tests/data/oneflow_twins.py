"""OneFlow twins whose per-rank memory grows with the world size through one SBP conversion each,
eager and under nn.Graph, and a healthy data-parallel job (tests/test_oneflow_eager_boxing.py)."""
import oneflow as flow

ROWS, FEATURES, HIDDEN = 4096, 256, 1024  # 4 MiB of batch, 16 MiB of activation a rank (float32)


class Net(flow.nn.Module):
    def __init__(self, placement, mix=False):
        super().__init__()
        self.w = flow.nn.Parameter(flow.ones(FEATURES, HIDDEN, placement=placement, sbp=flow.sbp.broadcast) / FEATURES)
        # split by row: added to a partial sum (P->S(0)), then read whole by a matmul (S(0)->B), a gather
        # the job never wrote
        self.mix = flow.nn.Parameter(flow.zeros(FEATURES, FEATURES, placement=placement, sbp=flow.sbp.split(0))) \
            if mix else None
        self.broadcast_activation = False

    def forward(self, x):
        if self.mix is not None:
            x = x + flow.matmul(x, flow.matmul(x, x, transpose_a=True) + self.mix)  # SBP inference boxes here
        h = flow.matmul(x, self.w)
        if self.broadcast_activation:
            h = h.to_global(sbp=flow.sbp.broadcast)  # the activation on every rank, whole
        return flow.relu(h)


class Step(flow.nn.Graph):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def build(self, x):
        return self.net(x).sum()


def batch():
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    x = flow.ones(ROWS * world, FEATURES, placement=placement, sbp=flow.sbp.split(0)) / FEATURES
    return placement, x


def run(graph=False, mix=False, broadcast_activation=False, broadcast_batch=False, steps=2):
    placement, x = batch()
    net = Net(placement, mix)
    net.broadcast_activation = broadcast_activation
    if broadcast_batch:
        x = x.to_global(sbp=flow.sbp.broadcast)  # the batch on every rank before the call
    step = Step(net) if graph else (lambda x: net(x).sum())
    for _ in range(steps):
        loss = step(x)
    return loss.to_global(sbp=flow.sbp.broadcast).to_local().item()


def train_data_parallel(steps=2):
    """Healthy: batch split, weights broadcast, gradients all-reduced (P->B) before the optimizer's step."""
    placement, x = batch()
    net = Net(placement)
    opt = flow.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(steps):
        loss = net(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.to_global(sbp=flow.sbp.broadcast).to_local().item()
