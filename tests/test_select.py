"""Plan selection by the compiled program (``ad.plan(select="compiled")``):
the plan returned is never slower, by its compiled program on the plan's
cluster, than a textbook plan written as a user writes it; every lowering
selection may return computes the unsharded step."""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import autoddl_jax as ad
from autoddl_jax import _hlo
from autoddl_jax._seeds import TEXTBOOK
from autoddl_jax._select import compiler_options, select
from autoddl_jax._verify import (REMAT_WARNING, CompiledScore, compile_log,
                                 compile_plan)
from conftest import TEST_CLUSTER
from helpers import make_mesh, rel_err
from test_zoo import _assert_state_close

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import zoo  # noqa: E402


@functools.lru_cache(maxsize=None)
def _selected(name: str, shape: tuple[int, ...]) -> tuple[zoo.Case, ad.Plan]:
  case = zoo.build(name, abstract=True)
  plan = ad.plan(case.step, *case.args, mesh=make_mesh(shape, explicit=False),
                 cluster=TEST_CLUSTER, select="compiled",
                 select_s=600)
  return case, plan


def _user_compiled(case: zoo.Case, mesh, textbook: ad.Plan):
  """The textbook plan compiled as a user writes it: jax.jit of the step
  with its in/out shardings, XLA propagating the rest."""
  named = lambda t: jax.tree.map(  # noqa: E731
      lambda s: NamedSharding(mesh, s), t,
      is_leaf=lambda x: isinstance(x, PartitionSpec))
  ins = named(textbook.in_specs)
  args = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      case.args, ins)
  return jax.jit(case.step, in_shardings=ins,
                 out_shardings=named(textbook.out_specs)).lower(
                     *args).compile(compiler_options(mesh))


@pytest.mark.parametrize("name,shape", [("llama", (2, 4)),
                                        ("resnet", (4, 2))])
def test_the_chosen_plan_is_never_slower_than_a_textbook_plan(name, shape):
  case, plan = _selected(name, shape)
  sel = plan.selection
  assert sel.mode == "compiled"
  assert sel.winner is not None and sel.candidates[sel.winner].compiled
  compiled, mesh = compile_plan(plan, compiler_options=compiler_options(
      plan.mesh))
  chosen = CompiledScore.of(compiled, mesh, plan.mesh_info, plan.cluster)
  # What selection measured is what the returned plan compiles to.
  assert chosen.time_s == pytest.approx(
      sel.candidates[sel.winner].compiled.time_s, rel=1e-9)
  for kind in TEXTBOOK:
    book = plan.textbook(kind)
    user = _user_compiled(case, mesh, book)
    theirs = CompiledScore.of(user, mesh, plan.mesh_info, plan.cluster)
    assert chosen.time_s <= theirs.time_s * (1 + 1e-9), (kind, chosen,
                                                         theirs)
    # Selection's "as a user writes it" candidate is that program.
    cand = next(c for c in sel.candidates
                if c.name == kind and c.lowering == "boundary")
    assert cand.compiled is not None or cand.skipped.startswith("same")
    if cand.compiled is not None:
      assert cand.compiled.time_s == pytest.approx(theirs.time_s, rel=1e-6)
      assert cand.compiled.memory_bytes == theirs.memory_bytes
  assert _hlo.collectives(compiled, mesh)  # the plan shards the model
  # XLA did not have to replicate a tensor in full to run the chosen plan.
  assert sel.candidates[sel.winner].compiled.remat_warnings == 0
  text = plan.explain(max_rows=0)
  assert "selected by the compiled program" in text and "<- chosen" in text


def test_a_boundary_lowering_computes_the_unsharded_step():
  # The pinned lowering is held to the same on every zoo model in test_zoo.
  case = zoo.llama(tx=optax.sgd(0.1, momentum=0.9))
  mesh = make_mesh((2, 4), explicit=False)
  want = jax.jit(case.step)(*case.args)
  plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER,
                 select="model")
  for p in (plan.variant(plan.choice, "boundary", "search"),  # noqa: SLF001
            plan.textbook("fsdp_tp")):
    assert p.lowering == "boundary"
    got = p.jit()(*case.args)
    assert rel_err(got[-1], want[-1]) <= 1e-5  # the loss
    _assert_state_close(got[:-1], want[:-1])


def test_a_budget_rules_out_what_does_not_fit_by_memory_analysis():
  case, free = _selected("llama", (2, 4))
  peaks = {(c.name, c.lowering): c.compiled.memory_bytes
           for c in free.selection.candidates if c.compiled is not None}
  budget = sorted(peaks.values())[len(peaks) // 2]  # half of them fit
  plan = ad.plan(case.step, *case.args, mesh=make_mesh((2, 4),
                                                       explicit=False),
                 cluster=TEST_CLUSTER, select="compiled",
                 memory_budget=budget, select_s=600, alternatives=0)
  sel = plan.selection
  won = sel.candidates[sel.winner]
  assert won.fits and won.compiled.memory_bytes <= budget
  over = [c for c in sel.candidates if c.fits is False]
  assert over and all(c.compiled.memory_bytes > budget for c in over)
  fitting = [c.compiled.time_s for c in sel.candidates if c.fits]
  assert won.compiled.time_s == min(fitting)


def test_selection_is_by_the_model_where_nothing_can_be_compiled():
  case = zoo.build("mixer", abstract=True)
  amesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  plan = ad.plan(case.step, *case.args, mesh=amesh, cluster=TEST_CLUSTER)
  assert plan.selection.mode == "model"
  assert "abstract mesh" in plan.selection.reason
  assert "selected by the cost model: abstract mesh" in plan.explain()
  with pytest.raises(ValueError, match="needs a concrete jax.sharding.Mesh"):
    ad.plan(case.step, *case.args, mesh=amesh, select="compiled")
  mesh = make_mesh((2, 4))
  with pytest.raises(ValueError, match="select must be 'compiled' or"):
    ad.plan(case.step, *case.args, mesh=mesh, select="xla")
  with pytest.raises(ValueError, match="select_s must be a number"):
    ad.plan(case.step, *case.args, mesh=mesh, select_s=-1)
  with pytest.raises(ValueError, match="alternatives must be an int"):
    ad.plan(case.step, *case.args, mesh=mesh, alternatives=1.5)


def test_out_of_time_candidates_are_reported_not_compiled(monkeypatch):
  monkeypatch.delenv("AUTODDL_JAX_SELECT")  # the default: compiled
  case = zoo.build("mixer", abstract=True)
  plan = ad.plan(case.step, *case.args, mesh=make_mesh((2, 4)),
                 cluster=TEST_CLUSTER, select_s=0)
  sel = plan.selection
  assert sel.mode == "compiled" and sel.winner == 0  # only the first ran
  assert sel.candidates[0].compiled is not None
  # Each later one is out of time, or the first's program again (scored as
  # it was).
  assert all(c.skipped and (c.compiled is None or c.skipped.startswith(
      "same program")) for c in sel.candidates[1:])
  assert any("select_s=0 spent" in c.skipped
             for c in sel.candidates[1:])


def test_a_saved_plan_keeps_its_lowering(tmp_path):
  case = zoo.build("mixer", abstract=True)
  mesh = make_mesh((2, 4))
  book = ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER,
                 select="model").textbook("dp")
  book.save(tmp_path / "dp.json")
  back = ad.load_plan(tmp_path / "dp.json", case.step, *case.args,
                      mesh=mesh, cluster=TEST_CLUSTER)
  assert (back.lowering, back.source) == ("boundary", "dp")
  assert back.cost == book.cost
  assert back.in_specs == book.in_specs


def test_a_budget_nothing_fits_names_the_compiled_peak_too():
  case = zoo.build("mixer", abstract=True)
  with pytest.raises(ad.MemoryBudgetError, match=(
      r"memory_budget=1 KiB.*smallest plan found needs.*By memory_analysis, "
      r"the smallest compiled candidate needs")):
    ad.plan(case.step, *case.args, mesh=make_mesh((2, 4)),
            cluster=TEST_CLUSTER, memory_budget=1024, select="compiled",
            select_s=0)


# --------------------------------------------- "Involuntary full remat"


def _scan_sin(x):
  c, _ = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)
  return c * 2


def _exit_reshard_plan(rows: int) -> ad.Plan:
  """A plan whose result leaves the jit in another layout than the loop
  carried it in, across both mesh axes: (S0 over data and model) to S2
  over model. Left to XLA as one step, that reshard is a full
  rematerialisation."""
  x = jax.ShapeDtypeStruct((rows, 16, 32), jnp.float32)
  return ad.hand_plan(_scan_sin, x, mesh=make_mesh((2, 4), explicit=False),
                      in_shardings=PartitionSpec(("data", "model")),
                      out_shardings=PartitionSpec(None, None, "model"),
                      cluster=TEST_CLUSTER)


def test_the_compile_log_is_read_and_passed_on(capfd):
  plan = _exit_reshard_plan(8)
  mesh = plan.program.auto_mesh()  # noqa: SLF001
  for lowering, remats in (("boundary", 1), ("pinned", 0)):
    with compile_log() as log:
      compiled, _ = compile_plan(plan, lowering == "pinned")
    score = CompiledScore.of(compiled, mesh, plan.mesh_info, plan.cluster,
                             log="".join(log))
    # XLA logs the rematerialisation on each partitioning pass over the
    # program; what matters is whether it logs one at all.
    assert bool(score.remat_warnings) == bool(remats), (lowering, log)
  # The pinned lowering stages the result's reshard one mesh axis at a time.
  assert plan.verify().emitted_bytes == pytest.approx(
      plan.verify().predicted_bytes, rel=0.10)
  # Whatever was captured still reaches the user's stderr.
  assert REMAT_WARNING in capfd.readouterr().err
  x = jax.random.normal(jax.random.key(0), (8, 16, 32))
  assert rel_err(plan.jit()(x), jax.jit(_scan_sin)(x)) <= 1e-6


def test_selection_puts_a_full_remat_after_every_clean_program():
  remat = _exit_reshard_plan(8)  # its boundary rematerialises
  clean = _exit_reshard_plan(1024)  # 128x the bytes, staged: slower, clean
  win, sel = select([("remat", "boundary", remat),
                     ("clean", "pinned", clean)], budget=None,
                    time_limit=600, key=lambda p, low: (id(p), low))
  a, b = sel.candidates
  assert a.compiled.remat_warnings and not b.compiled.remat_warnings
  assert a.compiled.time_s < b.compiled.time_s  # the remat one scores better
  assert win == 1 and "without a full rematerialisation" in sel.reason
  assert "full remat" in dict((r[0], r[-1]) for r in sel.table())["remat"]


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("name", sorted(zoo.BUILDERS))
def test_tiny_zoo_plans_compile_without_full_remat(name, shape):
  # The search's plan, all pins: the plan selection compiles first and
  # returns on most cases (benchmarks/compare.py).
  case = zoo.build(name, abstract=True)
  plan = ad.plan(case.step, *case.args, mesh=make_mesh(shape, explicit=False),
                 cluster=TEST_CLUSTER, select="model")
  with compile_log() as log:
    compile_plan(plan, compiler_options=compiler_options(plan.mesh))
  assert REMAT_WARNING not in "".join(log)


def test_the_compare_plot_reads_ratios_from_compare_csv(tmp_path):
  # benchmarks/plot_compare.py: per case, the chosen and the search's own
  # compiled score over the best textbook plan that fits.
  import plot_compare
  rows = [
      # case 1: search pinned chosen at 8 ms; best fitting textbook fsdp
      # 10 ms (dp 5 ms does not fit the budget)
      ("llama", "8", "2x4", "0.6x DP", "search", "pinned", "8", "True",
       "True"),
      ("llama", "8", "2x4", "0.6x DP", "dp", "boundary", "5", "False",
       "False"),
      ("llama", "8", "2x4", "0.6x DP", "fsdp", "boundary", "10", "True",
       "False"),
      # case 2: nothing fits: not counted
      ("moe", "8", "2x4", "0.6x DP", "dp", "boundary", "5", "False",
       "True"),
  ]
  path = tmp_path / "c.csv"
  path.write_text("model,mesh,cluster,budget,candidate,lowering,xla_ms,"
                  "fits,chosen\n" + "\n".join(",".join(r) for r in rows))
  assert plot_compare.ratios([path]) == [("llama 8 2x4 0.6x DP", 0.8, 0.8)]


def test_a_scanned_gpt_leaves_its_layer_loop_without_a_full_remat():
  # Before the lowering staged a loop's exit reshard, this plan's forward
  # scan handed its activations from an 8-way batch split to the layout
  # after the loop in one constraint, and XLA replicated them to get there.
  # Two layers at GPT-12's width (the tiny zoo never hit this).
  from autoddl_jax.testing import models
  ex = models.gpt(models.GptConfig(vocab=32768, d_model=768, n_heads=12,
                                   n_layers=2, seq=1024, batch=32,
                                   scan=True), abstract=True)
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4), explicit=False),
                 select="model")
  assert plan.graph.result_links  # it has a layer loop
  with compile_log() as log:
    compile_plan(plan, compiler_options=compiler_options(plan.mesh))
  assert REMAT_WARNING not in "".join(log)


def test_fidelity_merges_split_runs_into_the_summary_of_one(tmp_path,
                                                            capsys):
  # benchmarks/fidelity.py --summarize: the committed table, split in two
  # files by model, merges back to the summary its own run printed.
  import fidelity
  text = open(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "benchmarks", "results",
      "fidelity.txt")).read()
  want = next(ln for ln in text.splitlines() if ln.startswith("fidelity:"))
  lines = text.splitlines()
  at = next(i for i, ln in enumerate(lines) if ln.startswith("model "))
  end = next(i for i in range(at, len(lines)) if not lines[i].strip())
  body = lines[at + 1:end]
  dp = [ln for ln in lines if ": predicted " in ln and " mesh " in ln]
  half = len(body) // 2 // 4 * 4  # whole cases (4 plans each)
  for name, part, dps in (("a", body[:half], dp[:half // 4]),
                          ("b", body[half:], dp[half // 4:])):
    (tmp_path / f"{name}.txt").write_text(
        "\n".join([lines[at], *part, "", *dps]) + "\n")
  fidelity.main(["--summarize", str(tmp_path / "a.txt"),
                 str(tmp_path / "b.txt")])
  out = capsys.readouterr().out
  assert want in out, (want, out[-600:])


def test_fidelity_resumes_the_cases_an_interrupted_run_logged(tmp_path,
                                                             capsys):
  # benchmarks/fidelity.py --resume: a case logged whole is taken from the
  # log, not planned or compiled again, and the summary counts it.
  import fidelity
  rows = [dict(model="llama", mesh="8", cluster="1x8", plan=name,
               pred_ms=ms, xla_ms=ms * 1.05,
               by_kind={"all-reduce": [2.0**20, 2.0**20]},
               flops=[1e9, 1e9], mem=[2.0**30, 1.5 * 2**30], tau=1.0)
          for name, ms in (("dp", 10.0), ("fsdp", 12.0), ("megatron", 11.0),
                           ("autoddl", 9.0))]
  case = dict(rows=rows, tau=1.0, dp=dict(model="llama", mesh="8",
                                          cluster="1x8", pred_ms=10.0,
                                          xla_ms=10.0))
  log = tmp_path / "run.err"
  log.write_text("[fidelity] llama mesh 8 cluster 1x8\nW1203 a warning\n"
                 f"[fidelity]   case {json.dumps(case)}\n")
  fidelity.main(["--size", "tiny", "--models", "llama", "--meshes", "8",
                 "--clusters", "1x8", "--resume", str(log)])
  out, err = capsys.readouterr()
  assert ("fidelity: time within 15% on 4/4 plans, bytes by kind within 10% "
          "on 4/4, peak memory within 30% on 0/4; Kendall tau >= 0.8 in 1/1 "
          "cases (mean +1.00)") in out, out[-800:]
  assert "finished in a resumed log" in err
  assert err.count("[fidelity]   case ") == 1  # logged again, for a resume
  # --summarize TABLE --resume LOG: the log's case replaces the table's
  # same case (a later run of part of the grid), nothing compiled.
  table = tmp_path / "table.txt"
  table.write_text(out)
  for r in rows:
    r["xla_ms"] = r["pred_ms"] * 1.5
  case["tau"] = -1.0
  log.write_text(f"[fidelity]   case {json.dumps(case)}\n")
  fidelity.main(["--summarize", str(table), "--resume", str(log)])
  merged = capsys.readouterr().out
  assert ("fidelity: time within 15% on 0/4 plans, bytes by kind within 10% "
          "on 4/4, peak memory within 30% on 0/4; Kendall tau >= 0.8 in 0/1 "
          "cases (mean -1.00)") in merged, merged[-800:]


def test_a_plan_over_the_budget_by_memory_analysis_is_searched_again(
    monkeypatch):
  # The model's memory is an estimate. Here it is made to under-count by
  # 3x: the search's plan then fits the budget by the model but not by
  # memory_analysis, and selection searches again under the budget scaled
  # by that error -- a plan that fits by the compiled program comes back.
  from autoddl_jax._problem import Problem
  case = zoo.build("mixer", abstract=True)
  mesh = make_mesh((8,), explicit=False)
  free = ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER,
                 select="compiled", alternatives=0, select_s=600)
  dp_peak = next(c.compiled.memory_bytes for c in free.selection.candidates
                 if c.name == "search")
  true_peak = Problem.peak_memory
  monkeypatch.setattr(Problem, "peak_memory",
                      lambda self, ch: true_peak(self, ch) / 3)
  budget = 0.6 * dp_peak
  plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER,
                 select="compiled", memory_budget=budget, alternatives=0,
                 select_s=600)
  sel = plan.selection
  names = [c.name for c in sel.candidates]
  assert sel.candidates[0].fits is False  # the model had it under
  assert "search:refit1" in names, names
  won = sel.candidates[sel.winner]
  assert won.fits and won.compiled.memory_bytes <= budget
  assert won.compiled.time_s == min(c.compiled.time_s
                                    for c in sel.candidates if c.fits)
  # Without the time to search again, the error says what to change.
  with pytest.raises(ad.MemoryBudgetError, match=(
      r"by the compiled programs.*Selection stopped at select_s=0 s.*a "
      r"larger select_s may find a plan that fits")):
    ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER,
            select="compiled", memory_budget=budget, alternatives=0,
            select_s=0)


def test_compare_resumes_the_cases_an_interrupted_run_logged(tmp_path,
                                                            capsys):
  # benchmarks/compare.py --resume: a case logged as a row is taken from the
  # log and not planned again (nothing here compiles: the one case the
  # command line names is in the log), and the summary counts it.
  import compare
  row = {"model": "llama", "mesh": "8", "cluster": "1x8", "budget": "-",
         "best_textbook": "dp", "textbook_ms": 10.0, "search_ms": 8.0,
         "search_vs": 0.8, "search_fits": True, "chosen": "search (pinned)",
         "chosen_ms": 8.0, "chosen_vs": 0.8, "pred_emit": 1.0, "remat": 0,
         "search_s": 1.0, "select_s": 2.0, "exact_gap": "",
         "pairwise_gap": ""}
  log = tmp_path / "run.err"
  log.write_text("[compare] {'model': 'llama'}\nW1203 a warning\n"
                 f"[compare]   row {json.dumps(row)}\n")
  assert compare._logged_rows([log]) == {("llama", "8", "1x8", "-"): row}
  compare.main(["--size", "tiny", "--models", "llama", "--meshes", "8",
                "--clusters", "1x8", "--budgets", "none", "--csv",
                str(tmp_path / "c.csv"), "--resume", str(log)])
  out, err = capsys.readouterr()
  assert "geometric mean 0.800, worse on 0 of 1 cases" in out
  assert "finished in a resumed log" in err
  assert not (tmp_path / "c.csv").exists()  # no candidate compiled


def test_compare_names_each_case_where_nothing_beats_a_textbook_plan(capsys):
  # Issue 12: "where no plan better than a textbook plan exists, say so per
  # case" -- also where the search's own plan is the textbook plan's program
  # (the ViT's DP on one node), not only where a textbook plan is returned.
  import compare
  base = {"mesh": "8", "cluster": "1x8", "budget": "-", "best_textbook": "dp",
          "search_fits": True, "pred_emit": 1.0, "remat": 0}
  cases = [dict(base, model="vit", chosen="search (pinned)", chosen_vs=1.0,
                search_vs=1.0),
           dict(base, model="t5", chosen="search (pinned)", chosen_vs=0.8,
                search_vs=0.8),
           dict(base, model="moe", chosen="fsdp (boundary)", chosen_vs=1.0,
                search_vs=1.2)]
  compare._summary(cases)
  out = capsys.readouterr().out
  named = [ln for ln in out.splitlines() if "no plan better" in ln]
  assert len(named) == 2, out
  assert "vit mesh 8" in named[0] and "moe mesh 8" in named[1]
  assert "better (by more than 0.1%) on 1" in out
