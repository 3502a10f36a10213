"""Encoder-decoder models (Hugging Face T5 and BART, small random-weight configs, labels given as a model input):
cuts inside the encoder and inside the decoder, the encoder's output travelling beside the decoder's hidden state,
eval equal to the model, threads training as sequential, and the local losses falling."""

from __future__ import annotations

import torch
from ppll_compile.heads.losses import to_target_length


def test_an_encoder_stage_head_predicts_every_target_token_from_its_mean_scores():
    scores = torch.randn(2, 5, 7)
    target = torch.randint(0, 7, (2, 3))
    got = to_target_length(scores, target)
    assert got.shape == (2, 3, 7)
    torch.testing.assert_close(got, scores.mean(1, keepdim=True).expand(2, 3, 7), rtol=0, atol=0)
    assert to_target_length(scores, torch.randint(0, 7, (2, 5))) is scores  # positions line up: unchanged
    assert to_target_length(scores, torch.randn(2, 3)) is scores  # a float target is no token target
