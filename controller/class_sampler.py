"""Samples the HTB class counters of every shaped point, every few milliseconds.

``topo.class_sample_ms`` > 0 starts it beside the link sampler. Each read is one
rtnetlink dump of the point's device (:meth:`topo.build.Network.point_classes`,
~15 us, no fork), so all eight access points of a 4-host fabric can be read every 2 ms
for well under a tenth of a core. The rows (schema: :mod:`agents.core.class_samples`)
are kept in typed arrays (8 bytes a value: a minute at 2 ms on 8 points is ~20 MB) and
written to ``classes.parquet`` when the run ends.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.core.class_samples import CLASS_COLUMNS
from agents.core.events import now_ns
from agents.core.files import write_atomic_with
from controller.sampler import PeriodicSampler
from topo import qdisc
from topo.build import Network

if TYPE_CHECKING:  # imported when the table is made: not at every controller's start
    import pandas as pd

_INT_COLUMNS = ("ts_ns", "sent_bytes", "data_bytes", "sent_pkts", "drops", "overlimits",
                "backlog_bytes")



#: The HTB class sample period (ms) of an MoE, pipeline or torchrun run whose config leaves
#: ``topo.class_sample_ms`` at 0: their transfers cross every access link of the fabric,
#: which only the class sampler reads, and a stage's send or a dispatch lasts a few to a
#: few tens of ms at 1 Gbit/s. 5 ms resolves them; at ~15 us a read (controller/
#: class_sampler.py) 8 points cost under 4 % of a core.
FABRIC_CLASS_SAMPLE_MS = 5.0
#: The fabric roles whose ``agent_limited`` rests on the class samples.
FABRIC_ROLES = ("expert", "stage")


def class_sample_ms(cfg: Any, remote: bool) -> float:
    """The HTB class sample period the controller runs (ms; 0 = none): the config's
    ``topo.class_sample_ms``, else :data:`FABRIC_CLASS_SAMPLE_MS` for an MoE or pipeline
    run all on this machine (class counters are read over rtnetlink, here only)."""
    t = cfg.topo
    if t.class_sample_ms > 0 or remote:
        return float(t.class_sample_ms)
    # A torchrun run's collectives cross every training host's access link too.
    return FABRIC_CLASS_SAMPLE_MS if t.role in FABRIC_ROLES or cfg.torchrun.script else 0.0


class ClassSampler(PeriodicSampler):
    """Reads every shaped point's HTB class every ``period_s``; :meth:`write` saves them."""

    def __init__(self, net: Network, period_s: float) -> None:
        super().__init__("class-sampler", period_s)
        self.net = net
        self.points = [(p.point.name, p.dev) for p in net.spec.places()
                       if net.rate_mbps(p.dev) is not None]
        self.cols: dict[str, array[int]] = {c: array("q") for c in _INT_COLUMNS}
        self.point_index = array("H")
        self.rate_mbps = array("d")

    def sample(self) -> None:
        for i, (point, dev) in enumerate(self.points):
            classes = self.net.point_classes(point)
            t = now_ns()
            c = classes[qdisc.CLASS_ID]
            data = classes.get(qdisc.DATA_CLASS_ID, c)  # no ack_first: one class for all
            cols = self.cols
            cols["ts_ns"].append(t)
            cols["sent_bytes"].append(c.sent_bytes)
            cols["data_bytes"].append(data.sent_bytes)
            cols["sent_pkts"].append(c.sent_pkts)
            cols["drops"].append(c.drops)
            cols["overlimits"].append(c.overlimits)
            cols["backlog_bytes"].append(c.backlog_bytes)
            self.point_index.append(i)
            self.rate_mbps.append(self.net.rate_mbps(dev) or 0.0)

    def frame(self) -> pd.DataFrame:
        import pandas as pd

        n = len(self.point_index)
        data: dict[str, object] = {c: list(self.cols[c][:n]) for c in _INT_COLUMNS}
        data["point"] = [self.points[i][0] for i in self.point_index[:n]]
        data["dev"] = [self.points[i][1] for i in self.point_index[:n]]
        data["rate_mbps"] = list(self.rate_mbps[:n])
        return pd.DataFrame(data, columns=list(CLASS_COLUMNS))

    def write(self, path: Path) -> None:
        frame = self.frame()
        write_atomic_with(path, lambda fh: frame.to_parquet(fh, index=False))
