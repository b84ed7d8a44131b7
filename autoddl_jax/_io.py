"""Plans as versioned JSON: :meth:`Plan.save` and :func:`load_plan`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autoddl_jax._errors import PlanFileError
from autoddl_jax._version import __version__
from autoddl_jax import pipeline
from autoddl_jax._remat import POLICIES
from autoddl_jax._select import LOWERINGS

if TYPE_CHECKING:  # for annotations only: _plan imports this module
  from autoddl_jax._plan import Plan
  from autoddl_jax._program import Program
  from autoddl_jax._trace import Traced

FORMAT = "autoddl_jax.plan"
VERSION = 1


def program_fingerprint(tr: Traced) -> str:
  """sha256 of the traced program (its jaxpr) and its argument types."""
  h = hashlib.sha256()
  h.update(str(tr.closed.jaxpr).encode())
  for name, a in zip(tr.in_names, tr.in_avals):
    h.update(f"{name}:{a.str_short()}".encode())
  return h.hexdigest()


def _mesh_dict(plan: Plan) -> dict[str, int]:
  mi = plan.mesh_info
  return dict(zip(mi.axis_names, mi.axis_sizes))


def to_json(plan: Plan) -> dict[str, Any]:
  mi = plan.mesh_info
  tr = plan.traced
  args = []
  for name, a, s, spec in zip(tr.user_paths(), tr.in_avals, plan.in_sbps,
                              _flat_specs(plan)):
    args.append(dict(path=name, shape=list(a.shape), dtype=str(a.dtype),
                     sbp=repr(s), spec=str(spec)))
  return {
      "format": FORMAT,
      "version": VERSION,
      "autoddl_jax": __version__,
      "fingerprint": {
          "program": program_fingerprint(plan.traced),
          "mesh": _mesh_dict(plan),
          "cluster": dataclasses.asdict(plan.cluster),
      },
      "links": dict(zip(mi.axis_names, mi.link)),
      "choice": [int(c) for c in plan.choice],
      "cost": dataclasses.asdict(plan.cost),
      "seed": None if plan.search is None else plan.search.seed,
      "lowering": plan.lowering,
      "source": plan.source,
      "remat": plan.remat if isinstance(plan.remat, str) else
               list(plan.remat),
      "pipeline": None if plan.schedule is None else
                  dataclasses.asdict(plan.schedule),
      "arguments": args,
  }


def _flat_specs(plan: Plan):
  import jax
  from jax.sharding import PartitionSpec
  return jax.tree_util.tree_leaves(
      plan.in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def save(plan: Plan, path: str | os.PathLike) -> None:
  """Writes atomically: a temp file in the same folder, then a rename."""
  data = json.dumps(to_json(plan), indent=1)
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".tmp", dir=folder)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp makes the file private (0600); a plan file is an ordinary
    # file, with the permissions the user's umask gives a new one.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def read(path: str | os.PathLike) -> dict[str, Any]:
  """The JSON of a plan file, checked for format and version."""
  path = os.fspath(path)
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise PlanFileError(f"cannot read plan file {path!r}: {e}") from e
  try:
    data = json.loads(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise PlanFileError(
        f"plan file {path!r} is corrupted (not UTF-8 text: byte "
        f"{e.start}); save the plan again") from e
  except json.JSONDecodeError as e:
    raise PlanFileError(
        f"plan file {path!r} is truncated or corrupted (not valid JSON: "
        f"{e.msg} at line {e.lineno}); save the plan again") from e
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise PlanFileError(f"{path!r} is not an autoddl_jax plan file (no "
                        f"'format': {FORMAT!r})")
  if data.get("version") != VERSION:
    raise PlanFileError(
        f"plan file {path!r} has format version {data.get('version')!r}; "
        f"this autoddl_jax reads version {VERSION}. Re-plan and save again")
  for key in ("fingerprint", "choice", "arguments"):
    if key not in data:
      raise PlanFileError(f"plan file {path!r} is corrupted: no {key!r}")
  problem = _schema_problem(data)
  if problem:
    raise PlanFileError(f"plan file {path!r} is corrupted: {problem}; save "
                        "the plan again")
  return data


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, int | float) and not isinstance(x, bool)


def _schema_problem(data: dict[str, Any]) -> str | None:
  """What in a parsed plan file is not of the form :func:`to_json` writes
  (None when all is)."""
  fp = data["fingerprint"]
  if not isinstance(fp, dict):
    return f"'fingerprint' is a {type(fp).__name__}, not an object"
  if not isinstance(fp.get("program"), str):
    return "'fingerprint.program' is not a string"
  mesh = fp.get("mesh")
  if not (isinstance(mesh, dict) and mesh and all(
      isinstance(k, str) and _is_int(v) and v >= 1 for k, v in mesh.items())):
    return "'fingerprint.mesh' is not an object of axis name -> size"
  if not isinstance(fp.get("cluster"), dict):
    return "'fingerprint.cluster' is not an object"
  choice = data["choice"]
  if not (isinstance(choice, list) and all(_is_int(c) for c in choice)):
    return "'choice' is not a list of integers"
  args = data["arguments"]
  if not isinstance(args, list):
    return "'arguments' is not a list"
  for i, a in enumerate(args):
    if not (isinstance(a, dict) and all(isinstance(a.get(k), str) for k in
                                        ("path", "dtype", "sbp", "spec"))
            and isinstance(a.get("shape"), list)
            and all(_is_int(d) for d in a["shape"])):
      return (f"argument entry {i} is not an object with path, shape, dtype, "
              "sbp and spec")
  cost = data.get("cost", {})
  if not (isinstance(cost, dict) and all(_is_number(v)
                                         for v in cost.values())):
    return "'cost' is not an object of numbers"
  if not isinstance(data.get("links", {}), dict):
    return "'links' is not an object"
  if data.get("lowering", "pinned") not in LOWERINGS:
    return f"'lowering' is not one of {LOWERINGS}"
  if not isinstance(data.get("source", "search"), str):
    return "'source' is not a string"
  remat = data.get("remat", "none")
  names = [remat] if isinstance(remat, str) else remat
  if not (isinstance(names, list) and names and
          all(isinstance(n, str) and n in POLICIES for n in names)):
    return f"'remat' is not one of {', '.join(POLICIES)} (or a list of them)"
  return None


def load(path: str | os.PathLike, build: Callable[..., Program]
         ) -> tuple[Program, dict[str, Any]]:
  """Reads a plan file and builds its program (``build(remat, schedule)``:
  the step traced again with the file's remat policy and pipeline
  schedule); checks that the file was made for that program, mesh and
  cluster. Returns (the program, the file's data); raises
  :class:`PlanFileError` saying what differs."""
  data = read(path)
  remat = data.get("remat", "none")  # files before it: no remat
  remat = remat if isinstance(remat, str) else tuple(remat)
  sched = data.get("pipeline")  # files before it: no stages
  try:
    sched = None if sched is None else pipeline.Schedule(**sched)
  except (TypeError, ValueError) as e:
    raise PlanFileError(f"plan file {os.fspath(path)!r}: its 'pipeline' "
                        f"entry {data.get('pipeline')!r} is not a schedule: "
                        f"{e}") from None
  program = build(remat, sched)
  mi, tr = program.mesh_info, program.traced
  fp = data["fingerprint"]
  want_mesh = dict(zip(mi.axis_names, mi.axis_sizes))
  if fp.get("mesh") != want_mesh:
    raise PlanFileError(f"plan file {os.fspath(path)!r} was made for mesh "
                        f"{fp.get('mesh')}, not {want_mesh}")
  cluster = dataclasses.asdict(program.cluster)
  if fp.get("cluster") != cluster:
    diff = sorted(k for k, v in cluster.items()
                  if fp.get("cluster", {}).get(k) != v)
    raise PlanFileError(f"plan file {os.fspath(path)!r} was made for another "
                        f"cluster (differs in: {', '.join(diff)})")
  choice = data["choice"]
  if len(choice) != len(program.graph.ops) or not all(
      isinstance(c, int) and 0 <= c < len(program.problem.cands[o])
      for o, c in enumerate(choice)):
    raise PlanFileError(f"plan file {os.fspath(path)!r} does not fit this "
                        "program (its choices do not match the traced ops)")
  if program_fingerprint(tr) != fp.get("program"):
    old = {a["path"]: (tuple(a["shape"]), a["dtype"])
           for a in data["arguments"]}
    new = {n: (tuple(a.shape), str(a.dtype))
           for n, a in zip(tr.user_paths(), tr.in_avals)}
    changed = [k for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]
    what = (f"arguments differ: {', '.join(changed[:5])}" if changed else
            "the same argument types but a different computation")
    raise PlanFileError(f"plan file {os.fspath(path)!r} was made for another "
                        f"program ({what})")
  data.setdefault("lowering", "pinned")  # files before them
  data.setdefault("source", "search")
  return program, data


def show(path: str | os.PathLike) -> str:
  """A plan file as text, without the program it was made for."""
  data = read(path)
  fp = data["fingerprint"]
  cost = data.get("cost", {})
  lines = [f"autoddl_jax plan (format v{data['version']}, made by autoddl_jax "
           f"{data.get('autoddl_jax')}) on mesh {fp['mesh']} "
           f"(links: {data.get('links')})",
           f"program sha256 {fp['program'][:16]}...",
           f"predicted per device per step: time "
           f"{cost.get('time_s', float('nan')) * 1e3:.4g} ms, comm "
           f"{cost.get('comm_bytes', float('nan')):.4g} B, peak memory "
           f"{cost.get('memory_bytes', float('nan')):.4g} B",
           f"plan: {data.get('source', 'search')}, "
           f"{data.get('lowering', 'pinned')} lowering, remat "
           f"{data.get('remat', 'none')}"]
  rows = [("argument", "shape", "dtype", "nd-SBP", "PartitionSpec")]
  rows += [(a["path"], str(tuple(a["shape"])), a["dtype"], a["sbp"],
            a["spec"]) for a in data["arguments"]]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
  return "\n".join(lines)
