"""Lowering is transparent: the stages run in order give the model's own output, with its own parameters."""

import warnings

import pytest
import torch
import torchvision

import ppll_compile

ZOO = [
    # name, constructor kwargs, input size, stages
    ("resnet18", {}, 64, 4),
    ("resnet50", {}, 64, 3),
    ("vit_b_16", {"image_size": 32}, 32, 4),
    ("mobilenet_v2", {}, 64, 4),
    ("efficientnet_b0", {}, 64, 3),
    ("convnext_tiny", {}, 64, 4),
    ("swin_t", {}, 64, 2),
    ("densenet121", {}, 64, 3),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs,size,stages", ZOO, ids=[z[0] for z in ZOO])
def test_zoo_transparency(name, kwargs, size, stages):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10, **kwargs)
    x = torch.randn(2, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(model, gpus=stages, example_inputs=(x,))
    assert len(compiled.stages) == stages == compiled.plan.num_stages
    compiled.eval()  # the model and every stage
    with torch.no_grad():
        expected = model(x)
        got = compiled(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # the stages hold the model's own parameter objects, every one exactly once
    own = {id(p) for p in model.parameters()}
    staged = [id(p) for s in compiled.stages for p in s.parameters()]
    assert set(staged) == own
    assert len(staged) == len(own)


@pytest.mark.slow
def test_train_mode_switch_reaches_stochastic_layers():
    """Stochastic depth stays a switchable module: in train mode the pipeline is random, in eval it is not."""
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(num_classes=10, stochastic_depth_prob=0.5)
    x = torch.randn(2, 3, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(model, gpus=2, example_inputs=(x,))
    compiled.train()
    with torch.no_grad():
        a, b = compiled(x), compiled(x)
    assert not torch.allclose(a, b)
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), compiled(x))
