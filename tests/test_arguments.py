"""Public arguments checked: each misuse raises TypeError or ValueError naming the argument,
and leaves the model and optimizer as they were."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nvlm

x = mx.ones((2, 4))
tokens = mx.zeros((1, 5), dtype=mx.int32)
lengths = mx.array([[0, 4]])


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4), nn.Linear(4, 4)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


MODEL = Blocks()
OPTIMIZER = optim.Adam(1e-3)


def total(model, x):
    return model(x).sum()


def step():
    return nv.TrainingStep(MODEL, total, OPTIMIZER)


def reading():
    return nv.memory.Timeline([nv.memory.StageReading(0, 0, "outputs", None, 0.0, 1, 1)])


class NoCallbacks:
    pass


MISUSES = [
    (
        "update: gradients None",
        lambda: nv.update(OPTIMIZER, MODEL, None),
        TypeError,
        r"^gradients must be a dict of arrays mirroring model.trainable_parameters\(\)",
    ),
    (
        "update: gradients of another shape",
        lambda: nv.update(OPTIMIZER, MODEL, {"layers": [{"weight": mx.ones((3,))}]}),
        ValueError,
        r"^gradients\['layers.0.weight'\] must be an array of shape \(4, 4\) as the parameter, got shape",
    ),
    (
        "update: gradients of a parameter the model has not",
        lambda: nv.update(OPTIMIZER, MODEL, {"head": {"weight": mx.ones((4, 4))}}),
        ValueError,
        r"^gradients has 'head.weight', which is not a trainable parameter of model$",
    ),
    (
        "saved_activations: batch holds no array",
        lambda: nv.saved_activations(step(), 3),
        TypeError,
        r"^batch must be an mlx.core.array or a tuple of the loss's arguments holding arrays, got int$",
    ),
    (
        "TrainingStep: optimizer not an optimizer",
        lambda: nv.TrainingStep(MODEL, total, optimizer="adam"),
        TypeError,
        r"^optimizer must be an mlx.optimizers.Optimizer or None, got str$",
    ),
    (
        "TrainingStep: compile not a bool",
        lambda: nv.TrainingStep(MODEL, total, compile="yes"),
        TypeError,
        r"^compile must be a bool, got str$",
    ),
    (
        "largest_fit: make_batch returns no batch",
        lambda: nv.largest_fit(step(), lambda n: None, 1 << 30, progress=False),
        TypeError,
        r"^make_batch\(1\) must return an mlx.core.array or a tuple of the loss's arguments holding arrays, "
        r"got NoneType$",
    ),
    (
        "mlx_lm.chunked_loss: model not a module",
        lambda: nvlm.chunked_loss(total, tokens, lengths),
        TypeError,
        r"^model must be an mlx.nn.Module, got function$",
    ),
    (
        "mlx_lm.chunked_loss: batch not an array",
        lambda: nvlm.chunked_loss(MODEL, [[1, 2, 3]], lengths),
        TypeError,
        r"^batch must be an mlx.core.array of 2 dimensions \(token ids\), got list$",
    ),
    (
        "mlx_lm.chunked_loss: lengths of another shape",
        lambda: nvlm.chunked_loss(MODEL, tokens, mx.array([0, 4])),
        TypeError,
        r"^lengths must be an mlx.core.array of shape \(1, 2\) \(per row, the first and last position\), "
        r"got shape \(2,\)$",
    ),
    (
        "mlx_lm.train: training_callback without the callbacks",
        lambda: nvlm.train(MODEL, OPTIMIZER, [], training_callback=NoCallbacks()),
        TypeError,
        r"^training_callback must be None or an mlx_lm TrainingCallback \(on_train_loss_report, "
        r"on_val_loss_report\), got NoCallbacks$",
    ),
    ("Compiled: fn not callable", lambda: nv.Compiled(3), TypeError, r"^fn must be callable, got int$"),
    (
        "Plan.load_json: path not a path",
        lambda: nv.Plan.load_json(3),
        TypeError,
        r"^path must be a str or an os.PathLike, got int$",
    ),
    (
        "Timeline.save_json: path not a path",
        lambda: reading().save_json(None),
        TypeError,
        r"^path must be a str or an os.PathLike, got NoneType$",
    ),
    (
        "plan: an option it does not take",
        lambda: nv.plan(step(), (x,), budget=1 << 20, bugdet=1),
        TypeError,
        r"^plan\(\) got an unexpected keyword argument 'bugdet'$",
    ),
    (
        "largest_fit: an option it does not take",
        lambda: nv.largest_fit(step(), lambda n: (mx.ones((n, 4)),), 1 << 20, size=(1, 2)),
        TypeError,
        r"^largest_fit\(\) got an unexpected keyword argument 'size'$",
    ),
    (
        "saved_activations: an argument too many",
        lambda: nv.saved_activations(step(), (x,), 3),
        TypeError,
        r"^saved_activations\(\) takes 2 positional arguments but 3 were given$",
    ),
    (
        "save_names: no name",
        lambda: nv.policies.save_names(),
        ValueError,
        r"^save_names needs at least one name: a policy that keeps nothing is nv.policies.save_nothing$",
    ),
    (
        "Timeline.plot: title not a str",
        lambda: reading().plot("timeline.png", title=3),
        TypeError,
        r"^title must be a str, got int$",
    ),
]


def state():
    arrays = tree_flatten([MODEL.parameters(), OPTIMIZER.state])
    return [(k, v.tolist()) for k, v in arrays] + [mx.random.state[0].tolist()]


@pytest.mark.parametrize("misuse, error, match", [m[1:] for m in MISUSES], ids=[m[0] for m in MISUSES])
def test_a_misuse_raises_naming_the_argument_and_changes_nothing(misuse, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a misuse that is not refused would write
    before = state()
    with pytest.raises(error, match=match) as info:
        misuse()
    assert type(info.value) is error
    assert state() == before
    assert list(tmp_path.iterdir()) == []
