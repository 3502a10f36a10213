"""The causal-LM example: ``train_lm.py --quick`` trains end to end and by PPLL (K=2, 4) and lowers every perplexity."""

import math

import pytest

from tests.helpers import example_module

pytestmark = pytest.mark.slow  # an example runs end to end

pytest.importorskip("transformers")


@pytest.fixture
def train_lm(one_thread):  # a model this small runs as fast on one thread, and a busy machine slows it less
    return example_module("train_lm")


def test_train_lm_quick_lowers_every_perplexity(train_lm, capsys):
    rows = train_lm.main(["--quick"])
    out = capsys.readouterr().out
    assert [(r["method"], r["K"]) for r in rows] == [("end-to-end", 1), ("PPLL K=2", 2), ("PPLL K=4", 4)]
    untrained = rows[0]["untrained_ppl"]
    for r in rows:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1, r
        # the compiled pipeline, untrained, is the model itself: the same perplexity at step 0
        assert r["untrained_ppl"] == pytest.approx(untrained, rel=1e-4), r
        assert r["ppl"] < 0.5 * r["untrained_ppl"], f"{r['method']} did not learn: {r}\n{out}"
        assert len(r["stage_loss"]) == r["K"] and len(r["cuts"]) == r["K"] - 1
        assert f"{r['method']:<12} {r['ppl']:>8.3f} {r['untrained_ppl']:>9.2f}" in out, f"no table row in:\n{out}"
