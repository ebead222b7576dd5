"""nv.plan: the measured peak meets every budget from the plan's smallest to the unchecked peak."""

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx.planner.plan import EVERY_2ND
from tests.helpers import assert_close, held_while_unobserved, tiny_llama


def llama_case():
    model = tiny_llama(layers=8)  # with 4, one stage's run-to-run spread is 15% of the peak
    x = mx.random.randint(0, 256, (2, 129), key=mx.random.key(0))
    mx.eval(x)
    return model, lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean(), x, optim.Adam(1e-3)


def bench_case(model_name):
    from nuvec_mlx_bench import modules
    from nuvec_mlx_bench.workload import Workload

    w = (Workload("mlp", batch=256, dim=64, blocks=6) if model_name == "mlp"
         else Workload("transformer", batch=2, dim=64, blocks=4, seq=128))
    model, x = modules.build(w)
    return model, modules.loss, x, None


def weight_heavy_case():
    """The benchmark's MLP on a small batch, every weight trained: its weights outweigh its activations."""
    from nuvec_mlx_bench import modules
    from nuvec_mlx_bench.workload import Workload

    model, x = modules.build(Workload("mlp", batch=16, dim=128, blocks=6, weight_grads=True))
    return model, modules.loss, x


CASES = {"mlp": lambda: bench_case("mlp"), "transformer": lambda: bench_case("transformer"), "llama": llama_case}


@pytest.fixture(scope="module", params=list(CASES))
def planned(request):
    """A model and the plan for an unbounded budget (its measurements serve every replan)."""
    model, loss_fn, x, opt = CASES[request.param]()
    return model, loss_fn, x, opt, nv.plan(model, loss_fn, x, budget=1 << 40, optimizer=opt, progress=False)


def test_every_budget_from_the_smallest_to_unchecked_is_met_as_predicted(planned, compiled):
    model, _, _, _, first = planned
    layers = getattr(model, "layers", None) or model.model.layers
    before = [type(b) for b in layers], [(k, v.tolist()) for k, v in tree_flatten(model.parameters())]
    assert first.smallest < first.unchecked
    for k in range(4):
        budget = int(first.smallest + k * (first.unchecked - first.smallest) / 3)
        plan = first.replan(budget)
        assert plan.fits and plan.measured <= budget, str(plan)
        assert abs(plan.measured / plan.predicted - 1) <= 0.10, str(plan)
    after = [type(b) for b in layers], [(k, v.tolist()) for k, v in tree_flatten(model.parameters())]
    assert after == before, "planning changed the model"


def test_a_weight_heavy_step_s_update_stages_are_in_its_prediction(compiled):
    """With Adam on a small batch each block's update stage (nv.update) peaks above its backward stage:
    predicted as the block's own, the smallest peak is met (counted from backward stages alone, it is
    under-predicted by 1.4% and its budget missed)."""
    model, loss_fn, x = weight_heavy_case()
    first = nv.plan(model, loss_fn, x, budget=1 << 40, optimizer=optim.Adam(1e-3), progress=False)
    stages = next(iter(first._planner.profiles.values())).readings[0].stages
    assert [r.kind for r in stages].count("update") == 6  # the step measured updates as nv.update does
    for k in range(3):
        budget = int(first.smallest + k * (first.unchecked - first.smallest) / 2)
        plan = first.replan(budget)
        assert plan.fits and plan.measured <= budget, str(plan)
        assert abs(plan.measured / plan.predicted - 1) <= 0.10, str(plan)


def test_the_trial_measures_the_users_nv_update_step_not_its_own_undo(compiled):
    """Planning keeps the weights and moments from before each trial step, to put them back; the step
    it measures consumes copies, as the user's step consumes the originals. Kept alive by the undo, the
    old weights and moments add to the peak as each block's update replaces them (6.8 MiB too high here,
    with the copies taken out)."""
    model, loss_fn, x = weight_heavy_case()
    opt = optim.Adam(1e-3)
    least = nv.plan(model, loss_fn, x, budget=1, optimizer=opt, progress=False).apply()  # the smallest plan
    opt.init(model.trainable_parameters())
    state = [model.state, opt.state, mx.random.state]
    mx.eval(state)

    @nv.compile(inputs=state, outputs=state)
    def step(x):
        loss, grads = nv.value_and_grad(model, loss_fn)(model, x)
        nv.update(opt, model, grads)
        return loss

    nv.eval(step(x), state)
    with nv.memory.measure() as m:
        nv.eval(step(x), state)
    assert not least.fits and abs(least.start - m.start) <= 64 << 10, (least.start, m.start)
    assert abs(least.measured - (m.start + m.peak)) <= 256 << 10, (least.measured, m.start + m.peak)


def test_a_budget_below_the_smallest_reachable_peak_is_refused_with_that_peak(planned, compiled):
    *_, first = planned
    plan = first.replan(int(0.8 * first.smallest))
    assert not plan.fits and plan.measured > plan.budget
    assert plan.measured <= 1.1 * first.smallest
    assert "DOES NOT FIT" in str(plan) and "no plan fits" in str(plan)


def test_apply_checkpoints_the_blocks_as_planned_with_the_unchecked_gradients(compiled):
    model, loss_fn, x, _ = bench_case("transformer")
    reference = nv.value_and_grad(model, loss_fn)(model, x)[1]
    mx.eval(reference)
    first = nv.plan(model, loss_fn, x, budget=1 << 40, progress=False)
    plan = first.replan(int((first.smallest + first.unchecked) / 2))
    assert not any(nv.is_checkpointed(b) for b in model.layers)
    plan.apply()
    assert [nv.is_checkpointed(b) for b in model.layers] == [m != "plain" for m in plan.modes]
    assert {"plain", "save_matmuls", "save_nothing", "save_everything"} >= set(plan.modes)
    grads = nv.value_and_grad(model, loss_fn)(model, x)[1]
    nv.eval(grads)
    assert_close([v for _, v in tree_flatten(grads)], [v for _, v in tree_flatten(reference)], 1e-5)


def test_planning_leaves_the_optimizer_and_the_random_key_as_they_were(compiled):
    model, loss_fn, x, _ = bench_case("mlp")
    opt = optim.AdamW(1e-2)
    key = mx.random.state[0].tolist()
    for init in (False, True):  # a fresh optimizer stays uninitialised; an initialised one keeps its state
        if init:
            opt.init(model.trainable_parameters())
        held = [(k, v.tolist()) for k, v in tree_flatten(opt.state)]
        state = opt.state
        nv.plan(model, loss_fn, x, budget=1 << 40, optimizer=opt, progress=False)
        assert opt.state is state  # a step compiled with it before planning still updates it
        assert [(k, v.tolist()) for k, v in tree_flatten(opt.state)] == held
        assert mx.random.state[0].tolist() == key
    assert len(held) > 3


def test_a_plan_prints_as_a_table_and_writes_json(planned, tmp_path):
    model, *_, first = planned
    text = str(first)
    assert text.startswith("nv.plan for a budget of") and "keeps MiB" in text
    layers = getattr(model, "layers", None) or model.model.layers
    assert sum(line.strip().split()[0].isdigit() for line in text.splitlines()[4:]) == len(layers)
    data = json.loads(first.save_json(tmp_path / "plan.json").read_text())
    assert data["fits"] and len(data["blocks"]) == len(layers) and data["measured"] == first.measured


def test_a_measured_miss_is_corrected_and_shown(compiled):
    model, loss_fn, x, _ = bench_case("mlp")
    first = nv.plan(model, loss_fn, x, budget=1 << 40, progress=False)
    budget = int((first.smallest + first.unchecked) / 2)
    for profile in first._planner.profiles.values():  # a model that under-predicts every stage
        profile.keeps = [k // 4 for k in profile.keeps]
        profile.backward = [None if b is None else b // 4 for b in profile.backward]
    plan = first.replan(budget)
    assert plan.corrections and all(measured > budget for _, _, measured in plan.corrections)
    assert plan.fits and plan.measured <= budget
    assert "correction: predicted" in str(plan)


def test_the_smallest_reachable_peak_is_the_least_plans_as_its_step_runs(monkeypatch, compiled):
    model, loss_fn, x, _ = bench_case("mlp")
    observed = nv.plan(model, loss_fn, x, budget=1 << 40, progress=False)
    extra = 2 << 20
    held_while_unobserved(monkeypatch, extra)
    plan = nv.plan(model, loss_fn, x, budget=1 << 40, progress=False)
    assert plan.smallest >= observed.smallest + extra // 2, (plan.smallest, observed.smallest)
    assert "smallest reachable" in str(plan)


def test_a_plan_is_verified_as_its_step_runs_unobserved(monkeypatch, compiled):
    model, loss_fn, x, _ = bench_case("mlp")
    first = nv.plan(model, loss_fn, x, budget=1 << 40, progress=False)
    extra = 2 << 20
    budget = int((first.smallest + first.unchecked) / 2)
    first._planner.rules.clear()  # mixes only: a fixed rule measured faster may be taken at either replan
    observed = first.replan(budget)
    held_while_unobserved(monkeypatch, extra)
    plan = first.replan(budget)
    # The choice that fitted as observed misses as run: the planner corrects it, and still fits.
    assert observed.fits and not observed.corrections, str(observed)
    assert plan.corrections and plan.corrections[0][0] == observed.modes, str(plan)
    assert plan.corrections[0][2] >= observed.measured + extra - (256 << 10), str(plan)
    assert plan.fits and plan.measured <= budget, str(plan)


def test_a_fixed_rule_that_fits_and_ran_faster_is_taken_instead_of_the_mix(compiled):
    model, loss_fn, x, _ = bench_case("mlp")
    first = nv.plan(model, loss_fn, x, budget=1 << 40, progress=False)
    modes, readings = first._planner.rules[EVERY_2ND]
    assert modes.count("plain") == len(modes) // 2
    fits = max(r.peak for r in readings) + (1 << 20)
    assert fits < first.unchecked
    first._planner.rule_seconds[EVERY_2ND] = 1e-9  # as if far faster than any mix
    plan = first.replan(fits)
    assert plan.rule == EVERY_2ND and list(plan.modes) == list(modes), str(plan)
    assert plan.fits and plan.measured <= fits and abs(plan.measured / plan.predicted - 1) <= 0.10, str(plan)
    assert "taken: the fixed rule every 2nd block" in str(plan)
    assert plan.mix_seconds > 0 and not plan.corrections
    # Below what the rule needs it is not taken, however fast, and the mix fits.
    tight = first.replan(int(first.smallest + (max(r.peak for r in readings) - first.smallest) / 2))
    assert tight.rule != EVERY_2ND and tight.fits and tight.measured <= tight.budget, str(tight)


def test_a_plan_asked_to_synchronize_is_verified_and_timed_so(monkeypatch, compiled):
    from nuvec_mlx import evaluate

    model, loss_fn, x, _ = bench_case("mlp")
    calls = []
    real = evaluate.staged
    monkeypatch.setattr(evaluate, "staged", lambda *a, **kw: calls.append(kw["synchronize"]) or real(*a, **kw))
    budget = int(nv.plan(model, loss_fn, x, budget=1 << 40, progress=False).smallest * 1.5)
    calls.clear()
    plan = nv.plan(model, loss_fn, x, budget=budget, synchronize=True, progress=False)
    assert plan.fits and plan.synchronize and plan.to_dict()["synchronize"], str(plan)
    assert "synchronize=True" in str(plan)
    assert calls and all(calls), calls  # every step the planner ran was the user's step, synchronized
    assert not nv.plan(model, loss_fn, x, budget=budget, progress=False).synchronize
