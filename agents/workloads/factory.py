"""Builds the workload a config names (kept as an import path; the registry does the work).

Workloads register themselves by name, one file each (``agents.workloads.base.WORKLOADS``).
"""

from agents.workloads.base import make_workload

__all__ = ["make_workload"]
