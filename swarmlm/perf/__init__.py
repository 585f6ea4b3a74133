"""Performance model shared by planner, client router and simulator."""
from swarmlm.perf.model import ClientSpec, ComputeProfile, ModelSpec, Network, PerfModel, ServerSpec, Workload

__all__ = ["ClientSpec", "ComputeProfile", "ModelSpec", "Network", "PerfModel", "ServerSpec", "Workload"]
