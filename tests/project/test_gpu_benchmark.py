"""benchmarks/gpu.py's pure parts, and its plumbing end to end without a GPU: the weight
comparison that decides "equal to the CPU", and a run that writes gpu.json and one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _gpu_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "benchmarks"))  # its sibling _common, as when run
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_tells_bits_from_rounding_from_a_real_difference() -> None:
    gpu = _gpu_module()
    a = {"w": torch.tensor([1.0, -2.0, 4.0]), "empty": torch.empty(0)}
    same = gpu.compare(a, {k: v.clone() for k, v in a.items()})
    assert same["bit_identical"] and same["max_rel_diff"] == 0.0
    one_ulp = {"w": torch.nextafter(a["w"], torch.full((3,), 10.0)), "empty": torch.empty(0)}
    near = gpu.compare(a, one_ulp)
    assert not near["bit_identical"] and 0 < near["max_rel_diff"] < gpu.CPU_TOLERANCE
    far = gpu.compare(a, {"w": a["w"] * (1 + 1e-3), "empty": torch.empty(0)})
    assert far["max_rel_diff"] > gpu.CPU_TOLERANCE
    assert not gpu.compare(a, {"w": a["w"]})["comparable"]  # a tensor missing
    assert not gpu.compare({}, {})["comparable"]  # a run that saved nothing


def test_saved_weights_are_flattened_by_path(tmp_path: Path) -> None:
    gpu = _gpu_module()
    torch.save({0: torch.ones(2), 1: torch.zeros(3)}, tmp_path / "s0_final_weights.pt")
    torch.save([torch.ones(1)], tmp_path / "params.pt")
    got = gpu.load_weights([tmp_path / "s0_final_weights.pt", tmp_path / "params.pt"])
    assert sorted(got) == ["params/0", "s0_final_weights/0", "s0_final_weights/1"]


def test_the_script_writes_its_results_without_a_gpu(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path),
                          "--device", "cpu", "--only", "topk"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()
    line = json.loads(out[-1])
    assert line["name"] == "gpu" and line["headline"] == 0.0  # nothing compared
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["machine"]["tried_on"] == "cpu"
    want = "gpu" if torch.cuda.is_available() else "skipped"
    assert want in json.dumps(saved["topk"])
