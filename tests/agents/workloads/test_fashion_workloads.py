"""The Fashion-MNIST workloads: sizes from [vision], the parameter range the issue names,
a forward/backward, the Sequential cut points, the factory and the config's errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agents.core import config as cfgmod
from agents.workloads import fashion_mnist as fm
from agents.workloads.factory import make_workload
from agents.workloads.fashion_resnet import build_resnet
from agents.workloads.fashion_vit import build_vit


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("width,blocks,want", [(16, 1, 77_754), (16, 3, 272_186),
                                               (32, 1, 308_074), (64, 2, 2_776_522),
                                               (128, 2, 11_090_826)])
def test_resnet_parameter_counts(width: int, blocks: int, want: int) -> None:
    assert n_params(build_resnet(width, blocks)) == want


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_resnet_forward_backward_and_blocks(norm: str) -> None:
    m = build_resnet(8, 2, norm)
    assert isinstance(m, nn.Sequential)
    # stem (conv, norm, relu) + 3 stages x 2 blocks + pool, flatten, linear
    assert len(m) == 3 + 6 + 3
    out = m(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_vit_is_a_sequential_that_can_be_cut_anywhere() -> None:
    torch.manual_seed(0)
    m = build_vit(7, 32, 3, 4, 2)
    assert isinstance(m, nn.Sequential) and len(m) == 1 + 3 + 1
    assert n_params(m) == n_params(build_vit(7, 32, 3, 4, 2))
    x = torch.randn(2, 1, 28, 28)
    full = m(x)
    for cut in range(1, len(m)):
        h = m[:cut](x)
        torch.testing.assert_close(m[cut:](h), full)
    assert m[:1](x).shape == (2, 16, 32)  # 16 patches of 7x7, dim 32
    full.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_vit_default_size() -> None:
    assert n_params(build_vit(7, 64, 4, 4, 2)) == 138_890


def test_factory_builds_from_vision_section() -> None:
    cfg = cfgmod.from_dict({"workload": {"name": "fashion_resnet"},
                            "vision": {"resnet_width": 8, "resnet_blocks": 2,
                                       "resnet_norm": "batch", "eval_samples": 500}})
    wl = make_workload(cfg.workload, cfg.vision)
    assert wl.name == "fashion_resnet" and wl.describe()["width"] == 8
    assert n_params(wl.build_model(0)) == n_params(build_resnet(8, 2, "batch"))
    vit = make_workload(cfgmod.WorkloadConfig(name="fashion_vit"),
                        cfgmod.from_dict({"vision": {"vit_dim": 32, "vit_heads": 2}}).vision)
    assert vit.describe()["dim"] == 32
    a, b = vit.build_model(1), vit.build_model(1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("key,value,match", [
    ("resnet_norm", "layer", "must be one of group, batch"),
    ("vit_patch", 5, "must divide 28"),
    ("vit_dim", 30, "multiple of vit_heads"),
    ("eval_samples", 0, r"must be in \[1, 10000\]"),
    ("resnet_width", 1000, r"must be in \[2, 256\]"),
])
def test_vision_config_errors_name_the_field(key: str, value: object, match: str) -> None:
    with pytest.raises(cfgmod.ConfigError, match=f"vision.{key} = .*{match}"):
        cfgmod.from_dict({"vision": {key: value}})


@pytest.mark.skipif(not all((fm.DEFAULT_DIR / (s + ".gz")).exists() for s in fm.FILES.values()),
                    reason=f"Debian package {fm.DEBIAN_PACKAGE} not installed")
@pytest.mark.parametrize("name", ["fashion_resnet", "fashion_vit"])
def test_a_few_steps_on_real_data_lower_the_loss(name: str) -> None:
    torch.manual_seed(0)
    wl = make_workload(cfgmod.WorkloadConfig(name=name),
                       cfgmod.VisionConfig(resnet_width=8, vit_dim=32, vit_depth=2,
                                           eval_samples=200))
    model = wl.build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = wl.batch(0, 0, 1, 64)
    first = float(wl.loss(model, batch).detach())
    for _ in range(15):
        opt.zero_grad()
        wl.loss(model, batch).backward()
        opt.step()
    assert float(wl.loss(model, batch).detach()) < 0.95 * first
    m = wl.evaluate(model)
    assert 0.0 <= m["accuracy"] <= 1.0
