"""Heads built on the model's blocks and InfoPro as its paper builds it: transformer heads (fresh or copied blocks),
momentum (MAN) heads that follow the next stage by EMA, InfoPro's decoder, BCE target and per-stage weights."""

import pytest
import torch
from ppll_compile.heads.build import head_spec
from ppll_compile.heads.modules import head_loss
from tests.helpers import compile_quietly, SeqNet
from tests.helpers import heads_policy as policy


@pytest.fixture(scope="module")
def vit():
    """A timm ViT-Tiny of 4 blocks for 32x32 images (random init), compiled into 2 stages after blocks.0 with a
    transformer head that copies blocks.1 and blocks.2."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, num_classes=10)
    c = compile_quietly(model, torch.randn(4, 3, 32, 32), gpus=2, split_points=["add_2"],
                        policy=policy({"type": "transformer", "depth": 2, "init": "copy"}))
    return model, c


def test_a_copied_transformer_head_equals_the_next_stages_first_blocks_and_is_its_own(vit):
    model, c = vit
    assert [n for n, _ in c.stages[1].named_parameters()][0].startswith("module.blocks")
    assert not any("blocks_0" in n or "blocks.0" in n for n, _ in c.stages[1].named_parameters())
    head = c.lowered.heads[0]
    copies = head.net[0].blocks
    assert len(copies) == 2 and all(type(b) is type(model.blocks[1]) for b in copies)
    for copy, original in zip(copies, (model.blocks[1], model.blocks[2])):
        mine, theirs = list(copy.named_parameters()), list(original.named_parameters())
        assert [n for n, _ in mine] == [n for n, _ in theirs]
        for (name, p), (_, q) in zip(mine, theirs):
            assert torch.equal(p, q), name
            assert p.data_ptr() != q.data_ptr(), name  # a copy, not a view of the model's weights
    # training the head moves its blocks and leaves the model's alone
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head_before = [p.detach().clone() for p in copies.parameters()]
    opt = torch.optim.SGD(c.lowered.stage_parameters(c.plan.stages[0]), lr=0.5)
    h = torch.randn(4, 17, 192)
    head_loss(head, h, torch.randint(0, 10, (4,))).backward()
    model_grads = [n for n, p in model.named_parameters() if p.grad is not None]
    opt.step()
    assert model_grads == [] and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert any(not torch.equal(p, q) for p, q in zip(copies.parameters(), head_before))


def test_planning_costs_a_copy_head_as_its_blocks(vit):
    model, c = vit
    config = c.plan.stages[0].head.config
    boundary = c.plan.stages[0].boundary[0]
    given = head_spec(policy(), config, boundary, 10, None, "sgd", blocks=[model.blocks[1], model.blocks[2]])
    assert given.param_count == c.plan.stages[0].head.param_count == sum(
        p.numel() for p in c.lowered.heads[0].parameters())
    assert (given.flops_fwd, given.flops_bwd) == (c.plan.stages[0].head.flops_fwd, c.plan.stages[0].head.flops_bwd)
    # blocks of another shape than the stand-in are costed as themselves
    other = SeqNet(d=192, ratio=2).blocks[:2]  # MLP ratio 2: a smaller block than ViT's
    counted = head_spec(policy(), config, boundary, 10, None, "sgd", blocks=list(other))
    assert counted.param_count == sum(p.numel() for p in other.parameters()) + 2 * 192 + 192 * 10 + 10
    assert counted.param_count < given.param_count
