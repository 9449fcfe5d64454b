"""Zoo networks: the published parameter counts, and parity with torchvision by weights."""

import pytest
import torch
import torchvision

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


def test_every_zoo_net_builds_and_runs():
    for name in NETS:
        model = build_model(name, device="meta")
        assert model.output_shape == (model.num_classes,), name
    small = build_model("inception-small").eval()
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_alexnet_init_and_multipliers_follow_the_paper():
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
