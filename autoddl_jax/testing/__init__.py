"""Reference models and their hand plans, for the tests, examples, notebooks
and benchmarks (``from autoddl_jax.testing import models``).

Not part of the planner: nothing in ``autoddl_jax`` imports this package.
The held-out models the benchmarks judge plans on are in
``benchmarks/zoo.py``, written the way public model code is written.
"""
