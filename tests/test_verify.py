"""What ``plan.verify`` reads from the compiled program."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from autoddl_jax._verify import peak_bytes
from helpers import make_mesh


def test_peak_bytes_counts_the_temporaries():
  # y = x @ x.T must be materialised (it feeds a second contraction), so the
  # program needs at least y's local block on top of its arguments; the CPU
  # backend's peak_memory_in_bytes leaves temporaries out.
  mesh = make_mesh((8,), explicit=False)
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32,
                           sharding=NamedSharding(mesh, P("data")))

  def f(x):
    y = x @ x.T
    return (y @ y).sum()

  mem = jax.jit(f).lower(x).compile().memory_analysis()
  y_local = 1024 * 1024 * 4 // 8
  assert peak_bytes(mem) == (mem.argument_size_in_bytes
                             + mem.output_size_in_bytes
                             + mem.temp_size_in_bytes
                             - mem.alias_size_in_bytes)
  assert peak_bytes(mem) >= (mem.argument_size_in_bytes
                             + mem.output_size_in_bytes + y_local)


def test_dead_code_holds_no_memory():
  # jax.nn.relu's jvp leaves an unused zeros broadcast in every train
  # step's jaxpr; XLA removes it, so the model must not count it.
  import autoddl_jax as ad
  from autoddl_jax._verify import compile_plan

  mesh = make_mesh((8,), explicit=False)

  def f(x):
    jnp.zeros((4096, 4096)) + 1.0  # dead: 64 MiB nobody reads
    return (x * 2.0).sum()

  x = jnp.ones((1024, 128), jnp.float32)
  plan = ad.hand_plan(f, x, mesh=mesh, in_shardings=(P("data"),))
  compiled, _ = compile_plan(plan)
  xla = peak_bytes(compiled.memory_analysis())
  assert xla < 2**20
  assert plan.cost.memory_bytes < 2**20, plan.cost.memory_bytes
