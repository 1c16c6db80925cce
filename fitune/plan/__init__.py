"""`fitune plan`: search the training setups that fit a GPU and rank them by predicted speed. Pure Python.

- search.py: the space, the pruned search, the explanations (`plan(PlanRequest) -> PlanResult`);
- fast.py: memory estimates on 2- and 3-layer models, extrapolated to the full depth;
- throughput.py: predicted step time and tokens/s, calibrated on measured H200 steps (calibration.py);
- data.py: token lengths of a data file -> sequence length and packing;
- emit.py: a plan as a `fitune train` config or as Hugging Face code.
"""

from .search import Change, Plan, PlanRequest, PlanResult, Rejection, plan

__all__ = ["Change", "Plan", "PlanRequest", "PlanResult", "Rejection", "plan"]
