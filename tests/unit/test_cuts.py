"""Legal cuts: nodes that dominate the output; skip connections are never cut."""
import torch
from models import DictOut, Masked, Residual, TwoInputs

from ppll_compile.analysis.cuts import legal_cuts
from ppll_compile.capture.trace import trace
from ppll_compile.cost.nodes import measure_graph


def _cuts(model, *inputs):
    gm = trace(model, example_inputs=inputs)
    measure_graph(gm, inputs)
    return [(c.node, c.boundary) for c in legal_cuts(gm)]


def test_residual_blocks_are_cut_only_between_blocks():
    assert _cuts(Residual(), torch.randn(2, 3, 8, 8)) == [
        ("stem", ("stem",)), ("relu", ("relu",)), ("add", ("add",)), ("add_1", ("add_1",)), ("mean", ("mean",)),
    ]


def test_two_input_model_is_cut_between_its_branches_only_with_the_raw_input_carried():
    # after the left branch, the right branch's raw input b travels as a side value; inside no branch
    assert _cuts(TwoInputs(), torch.randn(2, 4), torch.randn(2, 6)) == [
        ("left", ("left", "b")), ("add", ("add",)), ("hidden", ("hidden",)), ("relu", ("relu",)),
    ]


def test_mask_read_by_every_block_travels_with_the_activations():
    assert _cuts(Masked(), torch.randn(2, 5, 8), torch.ones(2, 5)) == [
        ("embed", ("embed", "unsqueeze")), ("add", ("add", "unsqueeze")), ("add_1", ("add_1", "unsqueeze")),
        ("add_2", ("add_2",)), ("mean", ("mean",)),
    ]


def test_without_side_tensors_the_masked_model_has_only_its_tail_cuts():
    model, inputs = Masked(), (torch.randn(2, 5, 8), torch.ones(2, 5))
    gm = trace(model, example_inputs=inputs)
    measure_graph(gm, inputs)
    assert [c.node for c in legal_cuts(gm, max_side_values=0)] == ["add_2", "mean"]


def test_dict_output_whose_features_are_returned_too():
    assert _cuts(DictOut(), torch.randn(2, 4)) == [
        ("l1", ("l1",)), ("relu", ("relu",)), ("l2", ("l2",)), ("relu_1", ("relu_1",)),
    ]
