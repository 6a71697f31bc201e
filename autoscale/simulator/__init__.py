"""Fleet simulator: `run_simulation(policy, SimSettings()) -> SimResult` (the admin UI's Capacity page),
`simulate([...policies], settings)` for a comparison on one workload; `fleet simulate` on the command line."""
from autoscale.simulator.engine import SimResult, run_simulation, simulate
from autoscale.simulator.settings import POLICIES, SimSettings

__all__ = ["POLICIES", "SimResult", "SimSettings", "run_simulation", "simulate"]
