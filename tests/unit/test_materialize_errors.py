"""A meta-built model given bad values: a ``state_dict=`` loader returning no mapping, non-tensors or meta tensors, a
loader or a ``materialize=`` hook that raises. Each error names the stage, the key, what was found and the way out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.errors import PPLLError

pytestmark = pytest.mark.usefixtures("one_thread_quietly")
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


REFERENCE = _MLP().state_dict()


def _compile(**options):
    with torch.device("meta"):
        model = _MLP()
    return ppll_compile.compile(model, gpus=2, example_inputs=(X,), policy="dgl", **options)


def _error(**options) -> str:
    with pytest.raises(PPLLError) as info:
        _compile(**options)
    return str(info.value)


def test_a_loader_returning_no_mapping_is_named_by_stage():
    assert _error(state_dict=lambda stage, names: None) == (
        "the state_dict= loader returned None for stage 0, not a mapping name -> tensor; return a dict holding the "
        "names it is asked for (load(stage_index, names) -> {name: tensor})")


@pytest.mark.parametrize("value, found", [(1.5, "a float"), ([0.0] * 8, "a list"), (None, "None")])
def test_a_value_that_is_no_tensor_is_named_by_stage_and_key(value, found):
    def load(stage, names):
        return {k: value if k == "a.bias" else REFERENCE[k] for k in names}
    assert _error(state_dict=load) == (
        f"state_dict= gives {found} for 'a.bias' of stage 0, not a tensor; give a tensor of shape (8,) (e.g. from "
        f"torch.load(path, map_location='cpu') or safetensors.torch.load_file(path))")


@pytest.mark.parametrize("source", ["loader", "mapping"])
def test_a_meta_tensor_is_named_by_stage_and_key(source):
    on_meta = {k: v.to("meta") if k == "b.weight" else v for k, v in REFERENCE.items()}
    given = on_meta if source == "mapping" else (lambda stage, names: {k: on_meta[k] for k in names})
    with torch.device("meta"):
        model = _MLP()
    compiled = ppll_compile.compile(model, gpus=2, example_inputs=(X,), policy="dgl", state_dict=REFERENCE)
    index = next(i for i, s in enumerate(compiled.stages) if any(p is model.b.weight for p in s.parameters()))
    assert _error(state_dict=given) == (
        f"state_dict= gives a tensor on the meta device for 'b.weight' of stage {index}, which holds no values; "
        f"give real values (load the checkpoint with torch.load(path, map_location='cpu') or "
        f"safetensors.torch.load_file(path), not on the meta device)")


def test_a_raising_loader_is_named_by_stage():
    def load(stage, names):
        if stage == 1:
            raise KeyError("shard 2 missing")
        return {k: REFERENCE[k] for k in names}
    with pytest.raises(PPLLError) as info:
        _compile(state_dict=load)
    assert str(info.value) == (
        "the state_dict= loader load raised for stage 1 (KeyError: 'shard 2 missing'); fix the loader (it is called "
        "as load(stage_index, names) with the stage's state_dict keys)")
    assert isinstance(info.value.__cause__, KeyError)


def test_a_raising_materialize_hook_is_named_by_stage():
    def fill(stage_module, index, device):
        if index == 1:
            raise RuntimeError("no weights for this stage")
        for t in (*stage_module.parameters(), *stage_module.buffers()):
            torch.nn.init.zeros_(t)
    with pytest.raises(PPLLError) as info:
        _compile(materialize=fill)
    assert str(info.value) == (
        "the materialize= hook fill raised for stage 1 (RuntimeError: no weights for this stage); fix the hook (it "
        "is called as fn(stage_module, stage_index, device) for every stage this process runs)")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_good_values_still_load_exactly():
    compiled = _compile(state_dict=lambda stage, names: {k: REFERENCE[k] for k in names})
    reference = _MLP()
    reference.load_state_dict(REFERENCE)
    torch.testing.assert_close(compiled.eval()(X), reference.eval()(X), rtol=0, atol=0)
