"""Will it fit? A plan, the saved activations and the largest sequence for a small mlx-lm Llama.

    python examples/know_before_you_run.py [OUT_DIR]     # default benchmarks/results/cpu/plan/example

An 8-layer Llama (hidden 128, random weights), full fine-tuning with AdamW,
batches of 2 x 256 tokens. Prints the plan for a budget between the smallest
peak it can reach and the unchecked one, block 0 of the saved-activations
report, and the longest sequence that fits the same budget; writes the plan
and the report as JSON.
"""

import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models import llama

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB


def llama_and_tokens() -> tuple[nn.Module, mx.array, Callable]:
    """The example's model (random weights, seed 0), 2 x 2049 random tokens, and its loss."""
    mx.random.seed(0)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=128,
            num_hidden_layers=8,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=4096,
        )
    )
    tokens = mx.random.randint(0, 4096, (2, 2049), key=mx.random.key(1))
    mx.eval(model.parameters(), tokens)
    return model, tokens, lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()


def main(out: Path) -> None:
    model, tokens, loss_fn = llama_and_tokens()
    batch, opt = tokens[:, :257], optim.AdamW(1e-4)

    step = nv.TrainingStep(model, loss_fn, opt)  # the step the training loop runs
    planner = nv.Planner(step, batch)
    first = planner.plan(1 << 40)  # any budget: it measures the step, then reports the range
    budget = int(first.smallest + 0.4 * (first.unchecked - first.smallest)) // MiB * MiB
    plan = planner.plan(budget)
    print(plan)
    report = nv.saved_activations(step, batch, policy=nv.policies.save_matmuls, measure=True)
    print("\n" + str(report).split("\nblock 1 ")[0])
    print("...\n" + str(report).splitlines()[-1])
    fit = nv.largest_fit(step, lambda t: tokens[:, : t + 1], budget, sizes=(64, 128, 256), multiple=16)
    print("\nlongest sequence: " + str(fit))
    out.mkdir(parents=True, exist_ok=True)
    plan.save_json(out / "plan.json")
    report.save_json(out / "saved_activations.json")
    plan.apply()  # the blocks are now checkpointed as planned: step(batch) trains so


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cpu/plan/example"))
