import copy
import pickle

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma, gemma4_text, llama, qwen2

import nuvec_mlx as nv
from tests.helpers import Residual, assert_close, rise, tiny_llama

CFG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    rms_norm_eps=1e-5,
    vocab_size=128,
)


def make(arch, layers=2):
    mx.random.seed(0)
    cfg = dict(CFG, num_hidden_layers=layers)
    if arch == "llama":
        m = llama.Model(llama.ModelArgs(model_type="llama", **cfg))
    elif arch == "qwen2":
        m = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **cfg))
    else:
        m = gemma.Model(gemma.ModelArgs(model_type="gemma", head_dim=16, **cfg))
    mx.eval(m.parameters())
    return m


def loss(m, x):
    return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()


def grads(m, x):
    g = nn.value_and_grad(m, loss)(m, x)[1]
    mx.eval(g)
    return [v for _, v in tree_flatten(g)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_gradients_equal(arch):
    m = make(arch)
    x = mx.random.randint(0, 128, (2, 33))
    g0 = grads(m, x)
    assert nv.checkpoint_layers(m) == 2
    assert_close(grads(m, x), g0, 1e-5)
    original = type(make(arch).layers[0])
    assert all(type(layer) is not original and isinstance(layer, original) for layer in m.layers)
    assert nv.checkpoint_layers(m, enable=False) == 2
    assert all(type(layer) is original and not nv.is_checkpointed(layer) for layer in m.layers)


def test_layers_returning_arrays_and_python_values_give_plain_gradients():
    # gemma4_text's layers return (h, shared_kv, offset): the KV-shared layers
    # read an earlier layer's keys and values, offset is the int 0.
    mx.random.seed(0)
    m = gemma4_text.Model(
        gemma4_text.ModelArgs(
            hidden_size=32,
            num_hidden_layers=4,
            intermediate_size=64,
            num_attention_heads=2,
            head_dim=8,
            global_head_dim=16,
            vocab_size=64,
            vocab_size_per_layer_input=64,
            num_key_value_heads=1,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            sliding_window=16,
            sliding_window_pattern=2,
        )
    )
    mx.eval(m.parameters())
    assert m.model.previous_kvs == [0, 1, 0, 1]
    x = mx.random.randint(0, 64, (2, 12))
    g0 = grads(m, x)
    assert nv.checkpoint_layers(m) == 4
    assert_close(grads(m, x), g0, 1e-5)


def test_instance_level_and_every():
    m = make("llama")
    m2 = make("llama")
    cls, call = type(m2.layers[0]), type(m2.layers[0]).__call__
    assert nv.checkpoint_layers(m, every=2) == 1
    assert nv.is_checkpointed(m.layers[0]) and not nv.is_checkpointed(m.layers[1])
    assert not nv.is_checkpointed(m2.layers[0])
    # Other instances keep their class, and the class its __call__ (mlx-lm patches the class).
    assert type(m2.layers[0]) is cls and type(m.layers[1]) is cls and cls.__call__ is call
    assert nv.checkpoint_layers(m, layers=lambda mod: isinstance(mod, nn.RMSNorm)) > 0


def test_checkpoint_sequential_sqrt():
    mx.random.seed(1)
    layers = [nn.Linear(8, 8) for _ in range(5)]
    model = nn.Sequential(*layers)
    x = mx.random.normal((3, 8))
    run = nv.checkpoint_sequential(layers, "sqrt")
    g0 = nn.value_and_grad(model, lambda m, x: model(x).sum())(model, x)[1]
    g1 = nn.value_and_grad(model, lambda m, x: run(x).sum())(model, x)[1]
    assert_close([v for _, v in tree_flatten(g1)], [v for _, v in tree_flatten(g0)], 1e-5)
    with pytest.raises(ValueError, match="segments"):
        nv.checkpoint_sequential(layers, 9)


def test_checkpoint_sequential_takes_an_nn_sequential():
    mx.random.seed(2)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    x = mx.random.normal((3, 8))
    run = nv.checkpoint_sequential(model, 2)
    g0 = nn.value_and_grad(model, lambda m, x: model(x).sum())(model, x)[1]
    g1 = nn.value_and_grad(model, lambda m, x: run(x).sum())(model, x)[1]
    assert_close([v for _, v in tree_flatten(g1)], [v for _, v in tree_flatten(g0)], 1e-5)


def test_lora_only_adapters_train():
    from mlx_lm.tuner.lora import LoRALinear

    m = make("llama")
    m.freeze()
    for layer in m.layers:
        layer.self_attn.q_proj = LoRALinear.from_base(layer.self_attn.q_proj, r=4)
        layer.self_attn.q_proj.lora_b = mx.random.normal(layer.self_attn.q_proj.lora_b.shape) * 0.1
    x = mx.random.randint(0, 128, (2, 33))
    g0 = grads(m, x)
    assert len(g0) == 4  # lora_a, lora_b per layer
    nv.checkpoint_layers(m)
    assert_close(grads(m, x), g0, 1e-5)


def chunk_mlps(model, chunk, lazy_in_recompute=True):
    for layer in model.layers:
        nv.checkpoint_module(layer.mlp, chunk=chunk, lazy_in_recompute=lazy_in_recompute)


@pytest.mark.parametrize("blocks", [True, False], ids=["inside checkpointed blocks", "alone"])
def test_mlps_checkpointed_in_chunks_give_the_same_values_and_gradients(blocks):
    m = make("llama")
    x = mx.random.randint(0, 128, (2, 33))
    value = loss(m, x)
    g0 = grads(m, x)
    if blocks:
        nv.checkpoint_layers(m)
    chunk_mlps(m, 8)  # 32 tokens: 4 chunks
    assert all(nv.is_checkpointed(layer.mlp) for layer in m.layers)
    assert_close(loss(m, x), value, 1e-6)
    assert_close(grads(m, x), g0, 1e-5)
    c = pickle.loads(pickle.dumps(m))  # the chunk size travels with the module
    assert type(c.layers[0].mlp) is type(m.layers[0].mlp)
    assert_close(grads(c, x), g0, 1e-5)


@pytest.mark.parametrize(
    "chunk, lazy, stages",
    [(32, True, 0), (16, True, 8), (16, False, 12)],
    ids=["one chunk: as it is", "two chunks", "two chunks, staged in the recomputation"],
)
def test_a_module_in_chunks_runs_as_it_is_on_no_more_tokens_than_one_chunk(chunk, lazy, stages):
    """On 32 tokens, chunks of 32 are the MLP as it is (a lone chunk held more); chunks of 16 are two stages
    in each block's forward and backward pass, and in its recomputation too with ``lazy_in_recompute=False``
    (a pickled model keeps the setting)."""
    m = make("llama")
    nv.checkpoint_layers(m)
    chunk_mlps(m, chunk, lazy)
    m = pickle.loads(pickle.dumps(m))
    step = nv.TrainingStep(m, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"), optim.SGD(0.1))
    x = mx.random.randint(0, 128, (2, 33))
    with nv.memory.timeline() as t:
        step(x[:, :-1], x[:, 1:])
    assert [r.kind for r in t.readings].count("chunk") == stages


def lora_step_rise(mlp_chunk, tokens: int = 1024) -> float:
    """The median rise of three steps of a bfloat16 Llama (hidden 64) with mlx-lm's LoRA adapters on every
    linear layer, its blocks checkpointed, its MLPs in chunks of ``mlp_chunk`` tokens (``None``: whole)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    m = tiny_llama(layers=2, hidden=64, vocab=128)
    m.update(tree_map(lambda a: a.astype(mx.bfloat16), m.parameters()))
    m.freeze()
    linear_to_lora_layers(m, 2, {"rank": 8, "dropout": 0.0, "scale": 20.0})  # float32 adapters, as mlx-lm's
    nv.checkpoint_layers(m)
    nv.chunk_layers(m, nv.Chunks(mlp=None))  # attention in query chunks: the CPU trains it unfused
    if mlp_chunk:
        chunk_mlps(m, mlp_chunk)
    step = nv.TrainingStep(m, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"), optim.Adam(1e-3))
    x = mx.random.randint(0, 128, (1, tokens + 1))
    step(x[:, :-1], x[:, 1:])  # compiles
    return sorted(rise(lambda: step(x[:, :-1], x[:, 1:]), lambda out: None) for _ in range(3))[1]


def test_a_lora_block_s_backward_pass_holds_one_chunk_of_its_mlp():
    """mlx-lm's float32 adapters keep float32 copies of the MLP's activations in a block's backward pass:
    in 8 chunks the step peaks at about 0.64x (CPU, MLX 0.32)."""
    whole, chunked = lora_step_rise(None), lora_step_rise(128)
    print(f"step rise: MLP whole {whole / 2**20:.2f} MiB, in chunks {chunked / 2**20:.2f} MiB")
    assert chunked <= 0.8 * whole


def test_a_module_in_chunks_refuses_a_policy_and_an_input_it_cannot_split():
    with pytest.raises(TypeError, match="chunk must be an int"):
        nv.checkpoint_module(nn.Linear(2, 2), chunk="8")
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        nv.checkpoint_module(nn.Linear(2, 2), chunk=0)
    with pytest.raises(ValueError, match="chunk must be None with a policy"):
        nv.checkpoint_module(nn.Linear(2, 2), policy=nv.policies.save_matmuls, chunk=8)
    with pytest.raises(TypeError, match="lazy_in_recompute must be a bool"):
        nv.checkpoint_module(nn.Linear(2, 2), chunk=8, lazy_in_recompute=None)
    linear = nv.checkpoint_module(nn.Linear(2, 2), chunk=8)
    with pytest.raises(ValueError, match=r"must be an array of 2 or more dimensions, got shape \(2,\)"):
        linear(mx.zeros((2,)))


@pytest.mark.parametrize("clone", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy], ids=["pickle", "deepcopy"])
def test_checkpointed_modules_pickle_and_copy_as_checkpointed_modules(clone):
    m = make("llama")
    x = mx.random.randint(0, 128, (2, 9))
    g0 = grads(m, x)
    nv.checkpoint_layers(m)
    c = clone(m)
    assert all(nv.is_checkpointed(layer) for layer in c.layers)
    assert type(c.layers[0]) is type(m.layers[0])
    assert [k for k, _ in tree_flatten(c.parameters())] == [k for k, _ in tree_flatten(m.parameters())]
    assert_close(grads(c, x), g0, 1e-5)


def test_checkpointed_modules_keep_their_parameter_names_for_save_and_load(tmp_path):
    m = make("llama")
    names = [k for k, _ in tree_flatten(m.parameters())]
    nv.checkpoint_layers(m)
    m.save_weights(str(tmp_path / "w.safetensors"))
    plain = make("llama")
    plain.update(tree_map(mx.zeros_like, plain.parameters()))
    plain.load_weights(str(tmp_path / "w.safetensors"))
    assert sorted(mx.load(str(tmp_path / "w.safetensors"))) == sorted(names)
    assert_close([v for _, v in tree_flatten(plain.parameters())], [v for _, v in tree_flatten(m.parameters())])
    nv.checkpoint_layers(plain)
    plain.load_weights(str(tmp_path / "w.safetensors"))  # strict: every name found


class _Container(nn.Module):
    """Holds blocks but defines no __call__: nothing can call it through a checkpoint."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)


def test_modules_without_call_are_refused_before_anything_is_wrapped():
    model = nn.Sequential(nn.Linear(2, 2), _Container())
    with pytest.raises(TypeError, match=r"layers\[1\] \(_Container\) has no __call__"):
        nv.checkpoint_layers(model)  # model.layers
    with pytest.raises(TypeError, match=r"layers\[0\] \(_Container\) has no __call__"):
        nv.checkpoint_layers(model, layers=lambda mod: isinstance(mod, _Container))
    assert not any(nv.is_checkpointed(mod) for _, mod in model.named_modules())
    with pytest.raises(TypeError, match=r"module \(_Container\) has no __call__"):
        nv.checkpoint_module(_Container())


def test_errors():
    with pytest.raises(TypeError, match="module must be"):
        nv.checkpoint_module(3)
    with pytest.raises(ValueError, match="every"):
        nv.checkpoint_layers(make("llama"), every=0)
    with pytest.raises(ValueError, match="model.layers"):
        nv.checkpoint_layers(nn.Linear(2, 2))


def _step_peak(ckpt):
    m = make("llama", layers=8)
    if ckpt:
        nv.checkpoint_layers(m)
    opt = optim.AdamW(1e-3)
    opt.init(m.trainable_parameters())
    x = mx.random.randint(0, 128, (2, 513))
    vg = nn.value_and_grad(m, loss)
    state = [m.state, opt.state, mx.random.state]
    traces = []

    def step(x):
        traces.append(1)
        value, g = vg(m, x)
        opt.update(m, g)
        return value

    cstep = mx.compile(step, inputs=state, outputs=state)
    nv.eval([cstep(x), m.parameters(), opt.state])
    for _ in range(2):
        with nv.memory.measure() as mm:
            nv.eval([cstep(x), m.parameters(), opt.state])
    assert len(traces) == 1
    return mm.rise


@pytest.mark.slow
def test_compiled_training_step_peak_halved(compiled):
    base = _step_peak(False)
    ck = _step_peak(True)
    print(f"peak without {base / 2**20:.1f} MiB, with {ck / 2**20:.1f} MiB")
    assert ck <= 0.5 * base


class _Doubling(nn.Module):
    """Residual blocks (each returns ``x + tanh(linear(x))``, passed on as it is) whose loop doubles the
    hidden state before block 4: what a model's own code may do between blocks."""

    def __init__(self, dim: int = 32, blocks: int = 8):
        super().__init__()
        self.layers = [Residual(dim) for _ in range(blocks)]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(2 * x if i == 4 else x)
        return x


def _segment_step(segment, compile_step: bool, model=None, layers: int = 8, tokens: int = 256):
    """A step of a float32 Llama (hidden 32; or ``model``) with every block checkpointed in segments of
    ``segment`` blocks: its loss, its gradients, the active memory after its last forward stage above the
    step's start, and its forward stages."""
    m = tiny_llama(layers=layers, hidden=32, vocab=64) if model is None else model
    nv.checkpoint_layers(m, segment=segment)
    nv.chunk_layers(m, nv.Chunks(attention=None, mlp=None))
    if model is None:
        x = mx.random.randint(0, 64, (1, tokens + 1), key=mx.random.key(3))
        batch = (x[:, :-1], x[:, 1:])
        step = nv.TrainingStep(
            m, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"), compile=compile_step
        )
    else:
        batch = (mx.random.normal((tokens, 32), key=mx.random.key(3)),)
        step = nv.TrainingStep(m, lambda m, x: (m(x) ** 2).mean(), compile=compile_step)
    nv.eval(step(*batch))
    mx.synchronize()
    start = mx.get_active_memory()
    with nv.memory.timeline() as t:
        value, grads = step(*batch)
    forwards = [r for r in t.readings if r.kind == "forward"]
    return value, tree_flatten(grads), forwards[layers - 1].active - start, len(forwards)


@pytest.mark.parametrize("compile_step", [True, False], ids=["compiled", "eager"])
def test_segments_keep_every_kth_block_s_input_and_give_the_same_gradients(compiled, compile_step):
    """8 blocks of 256 x 32 float32 tokens (32 KiB each): after the forward pass the step holds every block's
    input and the last one's output (9), in segments of 4 the first blocks' of the 2 segments, the output,
    and one more (4); the backward pass recomputes 3 inputs per segment (a forward stage each), and the
    gradients are bitwise the same."""
    value, grads, held, forwards = _segment_step(1, compile_step)
    seg_value, seg_grads, seg_held, seg_forwards = _segment_step(4, compile_step)
    assert seg_value.item() == value.item()
    for (name, a), (_, b) in zip(seg_grads, grads, strict=True):
        assert mx.array_equal(a, b).item(), name
    block_input = 256 * 32 * 4
    assert held >= 8.75 * block_input and seg_held <= 4.25 * block_input, (held, seg_held)
    assert (forwards, seg_forwards) == (8, 8 + 2 * 3)


def test_a_block_whose_input_the_model_changed_starts_a_segment_of_its_own(compiled):
    """Block 4 reads twice block 3's output: its input is not what block 3 returned, so it keeps its input (a
    segment of its own, then blocks 5-7 with it): the step is exact, and blocks 1-3 and 5-7 recompute theirs."""
    model = _Doubling()
    mx.eval(model.parameters())
    weights = model.parameters()
    value, grads, _, forwards = _segment_step(1, True, model=model)
    nv.checkpoint_layers(model, enable=False)
    model.update(weights)
    seg_value, seg_grads, _, seg_forwards = _segment_step(8, True, model=model)
    assert seg_value.item() == value.item()
    for (name, a), (_, b) in zip(seg_grads, grads, strict=True):
        assert mx.array_equal(a, b).item(), name
    assert (forwards, seg_forwards) == (8, 8 + 3 + 3)


def test_segment_sizes_and_what_they_refuse():
    m = tiny_llama(layers=9, hidden=16, vocab=32)
    assert nv.checkpoint_layers(m, segment="sqrt") == 9  # segments of 3
    assert all(nv.is_checkpointed(b) for b in m.layers)
    with pytest.raises(ValueError, match="segment must be 1 with every=2: "):
        nv.checkpoint_layers(m, every=2, segment=3)
    with pytest.raises(ValueError, match="segment must be 1 with a policy: "):
        nv.checkpoint_layers(m, policy=nv.policies.save_matmuls, segment=3)
    with pytest.raises(ValueError, match="segment must be 'sqrt' or an int, got 'log'"):
        nv.checkpoint_layers(m, segment="log")
    loaded = pickle.loads(pickle.dumps(m))
    assert [type(b) for b in loaded.layers] == [type(b) for b in m.layers]
