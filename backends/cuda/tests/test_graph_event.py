"""``CudaDevice.graph_event``: a wait captured into a graph waits, at every replay, for the event's
latest record made before the replay (the offload connector's per-layer load events)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "no-wait-reads-stale"])
def test_captured_wait_orders_each_replay_behind_the_latest_record(wait):
    from hwkv_cuda.device import CudaDevice

    dev = CudaDevice()
    ev = dev.graph_event()
    x, y = torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    side, cap = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()

    def body() -> torch.Tensor:
        if wait:
            torch.cuda.current_stream().wait_event(ev)
        y.copy_(x)
        return y

    graph, _ = dev.capture_graph(body, dev.graph_pool(), cap)
    got = []
    for value in (1.0, 2.0, 3.0):
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the "copy" is still running when the graph is launched
            x.fill_(value)
            ev.record(side)
        graph.replay()
        torch.cuda.synchronize()
        got.append((float(y[0]), float(y[-1])))
    if wait:
        assert got == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]
    else:  # the check has teeth: without the captured wait the replay reads x before it is written
        assert got != [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]
