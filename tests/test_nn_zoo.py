"""Zoo networks: the published parameter counts, and parity with torchvision by weights."""

import math

import pytest
import torch
import torchvision
from torch import nn

from cnnkit import build_model
from cnnkit.zoo import NETS


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, params",
    [("alexnet", 60_965_224), ("caffenet", 60_965_224), ("alexnet-owt", 61_100_840)],
)
def test_seed_parameter_counts(name, params):
    assert count(build_model(name, device="meta")) == params


@pytest.mark.parametrize(
    "name, reference",
    [
        ("alexnet-owt", torchvision.models.alexnet),
        ("resnet18", torchvision.models.resnet18),
        ("vgg16", torchvision.models.vgg16),
    ],
)
def test_counts_match_torchvision(name, reference):
    with torch.device("meta"):
        expected = count(reference())
    assert count(build_model(name, device="meta")) == expected


def test_alexnet_owt_multiply_adds():
    macs = sum(row.macs for row in build_model("alexnet-owt", device="meta").table)
    assert 0.70e9 < macs < 0.72e9


@pytest.mark.parametrize(
    "name, reference",
    [("alexnet-owt", torchvision.models.alexnet), ("resnet18", torchvision.models.resnet18)],
)
def test_torchvision_weights_give_the_same_logits(name, reference):
    torch.manual_seed(0)
    ref = reference().eval()
    ours = build_model(name).eval()
    ours.load_state_dict(ref.state_dict())  # layer names match torchvision's
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() < 1e-5


FAMILIES = [  # torchvision's name (also ours), input size, torchvision's keyword arguments
    *[(f"resnet{d}", 64, {}) for d in (34, 50, 101, 152)],
    ("resnext50_32x4d", 64, {}),
    ("wide_resnet50_2", 64, {}),
    *[(f"vgg{d}{bn}", 32, {}) for d in (11, 13, 16, 19) for bn in ("", "_bn")],
    ("googlenet", 64, {"aux_logits": False, "init_weights": False}),
    ("densenet121", 64, {}),
    ("squeezenet1_0", 64, {}),
    ("squeezenet1_1", 64, {}),
    ("mobilenet_v2", 64, {}),
    ("mobilenet_v3_small", 64, {}),
    ("mobilenet_v3_large", 64, {}),
    ("efficientnet_b0", 64, {}),
    ("shufflenet_v2_x1_0", 64, {}),
    ("regnet_y_400mf", 64, {}),
    ("convnext_tiny", 64, {}),
]


NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)


@torch.no_grad()
def randomized(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """`model` given random weights and batch-norm statistics taken from `x`, so every
    parameter and buffer shapes the logits; in eval mode."""
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    done = set()
    for module in model.modules():
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if isinstance(module, (nn.Conv2d, nn.Linear)):  # variance-preserving, like He init
            weight.normal_(0, math.sqrt(2 / math.prod(weight.shape[1:])), generator=gen)
        elif isinstance(module, NORMS) and weight is not None:
            weight.uniform_(0.5, 1.5, generator=gen)
        else:
            continue
        if bias is not None:
            bias.normal_(0, 0.1, generator=gen)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # the first batch's statistics, exactly
        done.update(id(p) for p in (weight, bias) if p is not None)
    for p in model.parameters():  # ConvNeXt's layer scales
        if id(p) not in done:
            p.uniform_(0.5, 1.5, generator=gen)
    model.train()(x)
    return model.eval()


@pytest.fixture
def one_thread():
    """Small forward passes gain nothing from more threads; on a busy machine they only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name, size, kwargs", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_loads_torchvisions_state_dict_strictly_with_the_same_logits(
    name, size, kwargs, one_thread
):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    on = "cpu" if name.startswith("regnet") else "meta"  # RegNet's builder computes on tensors
    with torch.device(on):
        ref = torchvision.models.get_model(name, weights=None, **kwargs)
    ref = randomized(ref, x)
    ours = build_model(name, device="meta").eval()
    ours.load_state_dict(ref.state_dict(), assign=True)  # strict: every name and shape agrees
    with torch.no_grad():
        expected, got = ref(x), ours(x)
    assert expected.shape == (2, 1000) and expected.std() > 1e-3  # the logits say something
    assert (got - expected).abs().max().item() <= 1e-4


def test_published_files_of_googlenet_and_densenet_load_as_torchvision_loads_them(
    tmp_path, one_thread
):
    """googlenet's file holds the auxiliary heads; densenet's names `norm1` as `norm.1` (older
    torchvision): the network files' weights_keys drop and rename them, as torchvision does."""
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    densenet = torchvision.models.densenet121().eval()
    old = {k.replace("norm1.", "norm.1.").replace("norm2.", "norm.2.").replace(
        "conv1.", "conv.1.").replace("conv2.", "conv.2.") if ".denselayer" in k else k: v
           for k, v in densenet.state_dict().items()}  # fmt: skip
    assert "features.denseblock1.denselayer1.norm.1.weight" in old
    googlenet = torchvision.models.googlenet(aux_logits=True, init_weights=True).eval()
    assert any(k.startswith("aux1.") for k in googlenet.state_dict())
    for name, ref, state in (("densenet121", densenet, old), ("googlenet", googlenet, None)):
        torch.save(state or ref.state_dict(), tmp_path / f"{name}.pth")
        ours = build_model(name, weights=tmp_path / f"{name}.pth").eval()
        with torch.no_grad():
            assert (ours(x) - ref(x)).abs().max().item() <= 1e-4, name


def test_each_zoo_files_preprocessing_gives_torchvisions_published_weights_their_input(
    tmp_path, one_thread
):
    """From the same pixels: cnnkit's `preprocess` into cnnkit's network against torchvision's
    weights' transforms into torchvision's model as its published weights build it (googlenet
    with `transform_input` on: the file's mean and std must fold it in)."""
    from torchvision.models import get_model_weights

    from cnnkit.infer.load import network_preprocess
    from cnnkit.nn.spec import read_spec

    def preprocess(name: str):  # the file's own, as classify reads it; no network built
        description = read_spec(name)
        return network_preprocess(name, tuple(description["input"]), description["preprocess"])

    pixels = torch.randint(0, 256, (2, 3, 64, 64), generator=torch.Generator().manual_seed(2))
    for name in [n for n in NETS if n in torchvision.models.list_models()]:
        if name == "alexnet":  # cnnkit's alexnet is the 2012 network, not torchvision's
            continue
        pre = preprocess(name)
        weights = get_model_weights(name).IMAGENET1K_V1
        shown = weights.transforms()
        assert (pre.resize, pre.resize_mode, pre.crop) == (*shown.resize_size, "shorter",
                                                           *shown.crop_size), name  # fmt: skip
        wanted = "bicubic" if name == "efficientnet_b0" else "bilinear"  # cnnkit: bilinear
        assert shown.interpolation.value == wanted, name
        if name == "googlenet":
            continue
        assert pre.mean == pytest.approx([255 * m for m in shown.mean]), name
        assert pre.std == pytest.approx([255 * s for s in shown.std]), name
    ref = torchvision.models.googlenet(aux_logits=False, init_weights=True, transform_input=True)
    shown = get_model_weights("googlenet").IMAGENET1K_V1.transforms()
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (shown.mean, shown.std))
    x = (pixels / 255 - mean) / std  # torchvision's transforms' normalisation
    ref = randomized(ref, x)  # batch statistics of what the weights see: any scale shows
    torch.save(ref.state_dict(), tmp_path / "googlenet.pth")
    ours = build_model("googlenet", weights=tmp_path / "googlenet.pth").eval()
    with torch.no_grad():
        expected = ref(x)
        got = ours(preprocess("googlenet").normalize(pixels))
    # rounding only (with ImageNet's mean and std: 2783 off at a scale of 24)
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


def test_weights_key_rules_are_checked():
    from cnnkit import ConfigError

    base = {"input": [4], "layers": [{"type": "linear", "out_features": 2}]}
    for rule, words in (({"drop": "a", "match": "b", "to": "c"}, "a rule is {drop: REGEX}"),
                        ({"match": "b"}, "a rule is {drop: REGEX}"),
                        ({"drop": "("}, "not a regular expression")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            build_model({**base, "weights_keys": [rule]})
    from cnnkit.nn.weights import published_keys  # a pattern matching "" renames once

    rules = {"weights_keys": [{"drop": "gone"}, {"match": "(.*)", "to": r"x.\1"}]}  # in order
    assert published_keys({"abc": 1, "gone": 2}, rules) == {"x.abc": 1}


def test_every_zoo_net_builds_and_runs():
    for name in NETS:
        model = build_model(name, device="meta")
        assert model.output_shape == (model.num_classes,), name
    small = build_model("inception-small").eval()
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_alexnet_init_and_multipliers_follow_caffes_bvlc_alexnet():
    torch.manual_seed(0)
    model = build_model("alexnet")
    assert torch.all(model.conv1.bias == 0) and torch.all(model.conv2.bias == 0.1)
    assert torch.all(model.conv5.bias == 0.1) and torch.all(model.fc7.bias == 0.1)
    assert abs(model.conv1.weight.std().item() - 0.01) < 5e-4
    assert abs(model.fc6.weight.std().item() - 0.005) < 1e-4
    groups = {
        (g["lr"], g["weight_decay"]): len(g["params"]) for g in model.param_groups(0.01, 5e-4)
    }
    assert groups == {(0.01, 5e-4): 8, (0.02, 0.0): 8}  # weights; biases at 2x lr, no decay


def test_lrn_conventions_differ_in_zoo_alexnets():
    alexnet, caffenet = (
        build_model("alexnet", device="meta"),
        build_model("caffenet", device="meta"),
    )
    assert alexnet.norm1.k == 2 and abs(alexnet.norm1.alpha - 5e-4) < 1e-12  # paper: alpha * n
    assert caffenet.norm1.k == 1 and abs(caffenet.norm1.alpha - 1e-4) < 1e-12
    order = [row.type for row in caffenet.table[:4]]
    assert order == ["conv", "relu", "maxpool", "lrn"]  # CaffeNet pools before LRN


def test_initial_biases_are_each_caffe_models_own():
    """bvlc_reference_caffenet's train_val (and the 2012 paper) start conv2/4/5, fc6 and fc7 at
    bias 1; bvlc_alexnet at 0.1; the other layers at 0."""
    ones = {"conv2", "conv4", "conv5", "fc6", "fc7"}
    for name, value in (("caffenet", 1.0), ("alexnet", 0.1)):
        model = build_model(name)
        for layer in ("conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "fc8"):
            bias = model.get_submodule(layer).bias.detach()
            assert torch.all(bias == (value if layer in ones else 0.0)), (name, layer)


def test_copies_trace_and_channels_last_behave_like_the_original():
    import copy

    model = build_model("resnet18", num_classes=5).eval()
    twin = copy.deepcopy(model)  # optimizers' averaging and EMA deep-copy models
    with torch.no_grad():
        twin.fc.weight.add_(1.0)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert not torch.equal(twin(x), model(x))
        fast = copy.deepcopy(model).to(memory_format=torch.channels_last)
        torch.testing.assert_close(fast(x.to(memory_format=torch.channels_last)), model(x))


def test_a_replaced_layer_is_the_one_that_runs():
    model = build_model("resnet18", num_classes=5).eval()
    model.layer1.get_submodule("0").add_module("relu1", torch.nn.Tanh())  # e.g. SyncBatchNorm swaps
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        stem = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        block = model.layer1.get_submodule("0")
        inner = block.bn2(block.conv2(torch.tanh(block.bn1(block.conv1(stem)))))
        torch.testing.assert_close(
            block.relu2(inner + stem), _value_after(model, x, "layer1.0.relu2")
        )


def _value_after(model, x, name):
    """The output of layer `name` in a forward pass, caught by a hook."""
    seen = {}
    handle = model.get_submodule(name).register_forward_hook(lambda m, i, o: seen.update(out=o))
    model(x)
    handle.remove()
    return seen["out"]


INITIALISED = ["vgg11_bn", "densenet121", "googlenet", "convnext_tiny", "mobilenet_v3_small",
               "efficientnet_b0", "regnet_y_400mf", "resnet18", "squeezenet1_1"]  # fmt: skip


@pytest.mark.parametrize("name", INITIALISED)
def test_zoo_nets_start_where_torchvisions_start(name, one_thread):
    """Each tensor's spread as torchvision initialises it (within sampling noise), and zero
    where torchvision's is zero: training from scratch starts from the same distribution."""
    torch.manual_seed(0)
    kwargs = {"init_weights": True, "aux_logits": False} if name == "googlenet" else {}
    theirs = torchvision.models.get_model(name, weights=None, **kwargs).state_dict()
    ours = build_model(name).state_dict()
    for key, ref in theirs.items():
        if not ref.is_floating_point() or ref.numel() < 500 or "running" in key:
            continue
        std, got = ref.std().item(), ours[key].std().item()
        assert got == pytest.approx(std, rel=0.15, abs=1e-6), key
        assert (ref == 0).all().item() == (ours[key] == 0).all().item(), key


def test_groups_index_and_hook_like_torchvisions_containers(one_thread):
    """`model.layer4` is a group of layers the network runs one by one: it indexes like
    nn.Sequential and its forward hooks see (and may replace) what torchvision's see."""
    torch.manual_seed(0)
    ref = torchvision.models.resnet18().eval()
    ours = build_model("resnet18").eval()
    ours.load_state_dict(ref.state_dict())
    seen: dict[str, list] = {"ref": [], "ours": []}
    for name, model in (("ref", ref), ("ours", ours)):

        def keep(module, args, output, name=name):
            seen[name].append((args[0].clone(), output.clone()))

        model.layer4.register_forward_hook(keep)
        model.layer4[-1].register_forward_hook(keep)
        model.layer3[0].register_forward_hook(lambda m, a, out: out * 0.5)  # replaces the output
    assert len(ours.layer4) == 2 and ours.layer4[-1].conv2 is ours.layer4[1].conv2
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-5
    assert len(seen["ours"]) == len(seen["ref"]) == 2
    for (a, b), (c, d) in zip(seen["ours"], seen["ref"], strict=True):
        assert a.shape == c.shape and (a - c).abs().max() <= 1e-5 and (b - d).abs().max() <= 1e-5
    with pytest.raises(TypeError, match="runs as part of the network"):
        ours.layer4(x)
    with pytest.raises(TypeError, match="is not replaced whole .* replace a layer"):
        ours.layer4[1] = nn.Identity()  # (was: "'Group' object does not support item assignment")
    ours.fc = nn.Linear(512, 7)  # a layer replaced: the network runs it
    assert ours(x).shape == (2, 7)
    setattr(ours.layer4, "1", nn.Identity())  # (was: KeyError 'conv1' out of forward)
    with pytest.raises(TypeError, match=r"^layer4\.1\.conv1: no such layer in the network now"):
        ours(x)


def test_group_hooks_of_every_forward_kind_run_and_backward_ones_are_refused():
    net = build_model("resnet18").eval()
    heard = []
    net.layer4.register_forward_hook(lambda m, a, out: heard.append(("one", len(a))))
    net.layer4.register_forward_hook(lambda m, a, out: heard.append(("two", len(a))))
    net.layer4.register_forward_hook(lambda m, a, kw, out: heard.append(("kw", len(a), kw)),
                                     with_kwargs=True)  # fmt: skip
    net.layer2.register_forward_pre_hook(lambda m, a: heard.append(("pre", tuple(a[0].shape))))
    net(torch.zeros(1, 3, 64, 64))
    assert heard == [("pre", (1, 64, 16, 16)), ("one", 1), ("two", 1), ("kw", 1, {})]
    net.layer3.register_forward_pre_hook(lambda m, a: (a[0] * 2,))  # would miss the shortcut
    with pytest.raises(TypeError, match="cannot replace its input"):
        net(torch.zeros(1, 3, 64, 64))
    with pytest.raises(TypeError, match="takes no backward hooks"):
        net.layer4.register_full_backward_hook(lambda *args: None)


@pytest.mark.filterwarnings("ignore:NOTE. The nodes obtained by tracing")
@pytest.mark.parametrize("name", ["alexnet", "convnext_tiny", "digitnet"])
def test_torch_fx_and_torchvisions_feature_extractor_trace_a_network(name):
    """symbolic_trace and create_feature_extractor raised TraceError: cnnkit's own modules
    branched on x.dim() and x.device (a flattening linear layer, LRN, dropout, channel norms).
    Traced, they are torch's own; the traced graph computes what the network does."""
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    network = build_model(name).eval()
    x = torch.randn(2, *network.input_shape)
    traced = torch.fx.symbolic_trace(network)
    torch.testing.assert_close(traced(x), network(x), rtol=1e-4, atol=1e-4)
    first = next(n for n, m in network.named_modules() if isinstance(m, nn.Conv2d))
    features = create_feature_extractor(network, {first: "f"})(x)["f"]
    assert features.shape[0] == 2 and features.dim() == 4
    torch.fx.symbolic_trace(build_model(name).train())  # dropout and stochastic depth too
