"""SBP placements: ``ad.sbp.S(d)``, ``ad.sbp.B``, ``ad.sbp.P``, ``ad.sbp.NdSbp``.

A tensor's placement on a device mesh is an nd-SBP: one 1-D SBP per mesh axis
-- ``S(d)`` (dim ``d`` split across the axis), ``B`` (broadcast: every device
holds the whole) or ``P`` (partial sum: every device holds an addend). They
live in this namespace, not at the package's top, so that ``P`` does not
shadow the ``P = PartitionSpec`` idiom::

    from autoddl_jax import sbp
    plan.in_sbps[0] == sbp.NdSbp((sbp.S(0), sbp.B))

Their meaning as ``PartitionSpec``s is in :mod:`autoddl_jax._sbp`.
"""

from autoddl_jax._sbp import B as B
from autoddl_jax._sbp import P as P
from autoddl_jax._sbp import NdSbp as NdSbp
from autoddl_jax._sbp import S as S
from autoddl_jax._sbp import Sbp as Sbp

__all__ = ["B", "NdSbp", "P", "S", "Sbp"]
