"""autoddl_jax: automatic SBP sharding plans for JAX programs (AutoDDL).

>>> import autoddl_jax as ad
>>> plan = ad.plan(train_step, state, batch, mesh=mesh)   # doctest: +SKIP
>>> print(plan.explain())                                  # doctest: +SKIP
>>> step = plan.jit()                                      # doctest: +SKIP

The placements (``S(d)``, ``B``, ``P``) are in :mod:`autoddl_jax.sbp`.
"""

from autoddl_jax import checkpoint as checkpoint
from autoddl_jax import distributed as distributed
from autoddl_jax import pipeline as pipeline
from autoddl_jax import sbp as sbp
from autoddl_jax._api import cost_of as cost_of
from autoddl_jax._api import hand_plan as hand_plan
from autoddl_jax._api import load_plan as load_plan
from autoddl_jax._api import plan as plan
from autoddl_jax._auto import AutoShard as AutoShard
from autoddl_jax._auto import auto_shard as auto_shard
from autoddl_jax._cluster import H100_NODE as H100_NODE
from autoddl_jax._cluster import Cluster as Cluster
from autoddl_jax._errors import AutoDDLError as AutoDDLError
from autoddl_jax._errors import DistributedError as DistributedError
from autoddl_jax._errors import MemoryBudgetError as MemoryBudgetError
from autoddl_jax._errors import PlanFileError as PlanFileError
from autoddl_jax._errors import RuleError as RuleError
from autoddl_jax._graph import (
    UnsupportedPrimitiveWarning as UnsupportedPrimitiveWarning,
)
from autoddl_jax._hlo import Collective as Collective
from autoddl_jax._hlo import collectives as collectives
from autoddl_jax._plan import Plan as Plan
from autoddl_jax._problem import PlanCost as PlanCost
from autoddl_jax._sbp import NdSbp as NdSbp
from autoddl_jax._select import Candidate as Candidate
from autoddl_jax._select import Selection as Selection
from autoddl_jax._verify import CompiledScore as CompiledScore
from autoddl_jax._verify import Verification as Verification
from autoddl_jax._version import __version__ as __version__

__all__ = [
    "AutoDDLError", "AutoShard", "Candidate", "Cluster", "Collective",
    "CompiledScore", "DistributedError", "H100_NODE", "MemoryBudgetError",
    "NdSbp", "Plan", "PlanCost", "PlanFileError", "RuleError", "Selection",
    "UnsupportedPrimitiveWarning", "Verification", "auto_shard", "checkpoint",
    "collectives", "cost_of", "distributed", "hand_plan", "load_plan",
    "pipeline", "plan", "sbp",
]
