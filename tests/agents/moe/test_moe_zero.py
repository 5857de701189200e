"""ZeRO-2/3 parameter classes (agents/moe/zero.py) over a real loopback TCP mesh:
the same weights as plain data parallelism, and bytes per class equal to the formula."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from agents.moe.mesh import Mesh, file_keys
from agents.moe.zero import (
    ParamClass,
    ShardedOptimizer,
    class_bytes,
    classify,
    grad_resident_bytes,
    storage_bytes,
    zero3_resident_bytes,
)
from tests.agents.moe.test_moe_transparency import free_ports

_LOCK = threading.Lock()


def make_model() -> nn.Module:
    with _LOCK, torch.random.fork_rng():  # hosts are threads: one draw at a time
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5))  # 231 + 33 + 165 + 5


def data(step: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + h)
    return torch.randn(9, 7, generator=g), torch.randint(0, 5, (9,), generator=g)


def test_classify() -> None:
    w = torch.zeros(10, 10)
    assert classify("moe.0.experts.3.fc1.weight", w, 1) is ParamClass.EXPERT
    assert classify("experts.0.fc1.bias", w, 1) is ParamClass.EXPERT
    assert classify("embed.weight", w, 100) is ParamClass.ZERO3
    assert classify("embed.weight", w, 101) is ParamClass.ZERO2
    assert class_bytes(10, 1) == 0 and class_bytes(0, 4) == 0
    assert class_bytes(10, 3) == 2 * 2 * (4 * 4 + 64)  # shard ceil(10/3) = 4
    assert class_bytes(10, 3, "zero2") == 2 * 2 * (4 * 4 + 64)
    assert class_bytes(10, 3, "zero3") == 3 * 2 * (4 * 4 + 64)  # + the backward's gather


def test_storage_bytes_counts_each_storage_once() -> None:
    a = torch.zeros(10)
    assert storage_bytes([a, a[2:5], a.view(2, 5)]) == 40
    assert storage_bytes([a, torch.zeros(3, dtype=torch.float64), torch.empty(0)]) == 64
    assert zero3_resident_bytes(10, 3, gathered=False) == 16  # shard ceil(10/3) = 4
    assert zero3_resident_bytes(10, 3, gathered=True) == 16 * 4
    assert zero3_resident_bytes(0, 3, gathered=True) == 0


@pytest.mark.parametrize("regather", [True, False])
def test_zero_equals_plain_data_parallel(regather: bool) -> None:
    """ZeRO-3 gathers before the forward, frees, gathers again before the backward and
    frees: the weights are plain data parallelism's. After each free the host holds only
    its shard's bytes of the split class (the gathered buffer's storage is really gone:
    nothing, autograd's saved tensors included, keeps it alive), and after each gather
    shard + buffer. Without the backward's gather the backward finds the parameters
    freed and raises."""
    hosts = 3
    steps, lr, mom = 4, 0.1, 0.9
    # Plain data parallelism: every replica applies the mean of the hosts' gradients.
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=mom)
    for s in range(steps):
        opt.zero_grad()
        for h in range(hosts):
            x, y = data(s, h)
            (nn.functional.cross_entropy(ref(x), y) / hosts).backward()
        opt.step()

    base = free_ports(hosts)
    addrs = [("127.0.0.1", base + h) for h in range(hosts)]
    finals: dict[int, dict[str, torch.Tensor]] = {}
    bytes_seen: dict[int, list[dict[str, int]]] = {}
    errors: list[BaseException] = []

    def host(h: int) -> None:
        try:
            with Mesh(h, addrs, 99, run_id="zero", keys=file_keys(b"zero test", h, hosts)
                      ) as mesh:
                model = make_model()
                zopt = ShardedOptimizer(model, hosts=hosts, me=h, zero3_min_numel=100,
                                        lr=lr, momentum=mom)
                z3 = zopt.classes[ParamClass.ZERO3]
                seen = []
                for s in range(steps):
                    zopt.begin_step()
                    zopt.gather_before_use(mesh, s)
                    b = {"gathered": z3.resident_bytes()}
                    fwd_buffer = StorageWeakRef(model[0].weight.untyped_storage())
                    zopt.zero_grad()
                    x, y = data(s, h)
                    with zopt.saving_gathered():
                        loss = nn.functional.cross_entropy(model(x), y) / hosts
                    zopt.release()
                    b["freed_fwd"] = z3.resident_bytes()
                    b["fwd_buffer_alive"] = int(not fwd_buffer.expired())
                    if regather:
                        zopt.gather_before_backward(mesh, s)
                    loss.backward()
                    zopt.release()
                    # Before the reduce-scatter: each shared class's full gradient buffer.
                    b["grad_full"] = {c.value: sc.grad_bytes()
                                      for c, sc in zopt.classes.items()}
                    grad_buffers = [StorageWeakRef(sc.flat_grad.untyped_storage())
                                    for sc in zopt.classes.values()
                                    if sc.flat_grad is not None]
                    sent0 = sum(mesh.sent.values())
                    zopt.step(mesh, s)
                    b |= zopt.bytes_by_class() | zopt.param_bytes() | zopt.grad_bytes()
                    b["rs_ag2_wire"] = sum(mesh.sent.values()) - sent0
                    # After it: only each class's summed shard is held.
                    b["grad_after"] = {c.value: sc.grad_bytes()
                                       for c, sc in zopt.classes.items()}
                    b["grad_buffers_alive"] = sum(not w.expired() for w in grad_buffers)
                    b["shared_grads_left"] = sum(q.grad is not None
                                                 for sc in zopt.classes.values()
                                                 for q in sc.params)
                    seen.append(b)
                zopt.gather_before_use(mesh, steps)
                finals[h] = {n: p.detach().clone() for n, p in model.named_parameters()}
                bytes_seen[h] = seen
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=host, args=(h,)) for h in range(hosts)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    n3 = 7 * 33 + 33 * 5  # the two weight matrices: split (ZeRO-3)
    n2 = 33 + 5     # the biases: ZeRO-2
    if not regather:
        assert len(errors) == hosts, errors
        assert all("freed after the forward" in str(e) for e in errors), errors
        return
    assert not errors, errors
    for h in range(hosts):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(finals[h][name], p.detach(), atol=1e-6, rtol=1e-5)
        for b in bytes_seen[h]:
            assert b["expert"] == 0
            assert b["zero3"] == class_bytes(n3, hosts, "zero3")
            assert b["zero2"] == class_bytes(n2, hosts, "zero2")
            # What the mesh counted during the step: zero3's reduce-scatter (a third of
            # its formula) and zero2's reduce-scatter and all-gather.
            shard_bytes = 4 * -(-n3 // hosts)
            assert b["gathered"] == b["zero3_peak_bytes"] == (hosts + 1) * shard_bytes
            assert b["freed_fwd"] == b["zero3_freed_bytes"] == shard_bytes
            assert b["zero3_peak_formula_bytes"] == zero3_resident_bytes(n3, hosts,
                                                                         gathered=True)
            assert b["zero3_freed_bytes"] == b["zero3_freed_formula_bytes"]
            assert b["fwd_buffer_alive"] == 0 and b["zero3_buffers_kept_alive"] == 0
            assert b["zero2_bytes"] == 4 * hosts * -(-n2 // hosts)
            assert b["host_freed_bytes"] == shard_bytes + b["zero2_bytes"]
            assert b["rs_ag2_wire"] == (class_bytes(n3, hosts, "zero3") // 3
                                        + class_bytes(n2, hosts, "zero2"))
            # Gradients: the full buffer (H shards) until the reduce-scatter, then
            # only this host's summed shard; the buffer's storage is really gone.
            for kind, n in (("zero3", n3), ("zero2", n2)):
                shard = 4 * -(-n // hosts)
                assert b["grad_full"][kind] == hosts * shard
                assert b["grad_after"][kind] == b[f"{kind}_grad_freed_bytes"] == shard
                assert b[f"{kind}_grad_freed_formula_bytes"] == shard == \
                    grad_resident_bytes(n, hosts, freed=True)
                assert b[f"{kind}_grad_peak_bytes"] == (hosts + 1) * shard == \
                    b[f"{kind}_grad_peak_formula_bytes"]
            assert b["grad_buffers_alive"] == 0 and b["grad_buffers_kept_alive"] == 0
            assert b["shared_grads_left"] == 0
