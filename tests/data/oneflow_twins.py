"""OneFlow twins whose per-rank memory grows with the world size through one SBP conversion each,
eager and under nn.Graph, and a healthy data-parallel job (tests/test_oneflow_eager_boxing.py)."""
import oneflow as flow

ROWS, FEATURES, HIDDEN = 1024, 1024, 2048  # 4 MiB of batch, 8 MiB of activation, 8 MiB of weight a rank (float32)


class Net(flow.nn.Module):
    def __init__(self, placement, split_weight=False):
        super().__init__()
        # split by column: x (split by row) @ w needs one of them whole, a gather the job did not write
        sbp = flow.sbp.split(1) if split_weight else flow.sbp.broadcast
        self.w = flow.nn.Parameter(flow.ones(FEATURES, HIDDEN, placement=placement, sbp=sbp) / FEATURES)
        self.broadcast_activation = False

    def forward(self, x):
        h = flow.matmul(x, self.w)  # a split weight: SBP inference gathers x or w here
        if self.broadcast_activation:
            h = h.to_global(sbp=flow.sbp.broadcast)  # the activation on every rank, whole
        return h.relu()


class Step(flow.nn.Graph):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def build(self, x):
        return self.net(x).sum()


def batch():
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    x = flow.ones(ROWS * world, FEATURES, placement=placement, sbp=flow.sbp.split(0))
    return placement, x


def run(graph=False, split_weight=False, broadcast_activation=False, broadcast_batch=False, steps=2):
    placement, x = batch()
    net = Net(placement, split_weight)
    net.broadcast_activation = broadcast_activation
    if broadcast_batch:
        x = x.to_global(sbp=flow.sbp.broadcast)  # the batch on every rank before the call
    step = Step(net) if graph else (lambda x: net(x).sum())
    for _ in range(steps):
        loss = step(x)
    return loss.to_global(sbp=flow.sbp.broadcast).to_local().item()


def train_data_parallel(steps=2):
    """Healthy: batch split, weights broadcast, gradients all-reduced (P->B) by the optimizer's step."""
    placement, x = batch()
    net = Net(placement)
    opt = flow.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(steps):
        loss = net(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.to_global(sbp=flow.sbp.broadcast).to_local().item()
