"""The seq2seq example: ``train_t5.py --quick`` fine-tunes a small T5 end to end and by PPLL (K=2) from the same
weights on the same batches, and both loss curves fall."""

import pytest

from tests.helpers import example_module

pytestmark = pytest.mark.slow  # an example runs end to end

pytest.importorskip("transformers")


@pytest.fixture
def train_t5(one_thread):
    return example_module("train_t5")


def test_train_t5_quick_lowers_both_losses_from_the_same_start(train_t5, capsys):
    result = train_t5.main(["--quick"])
    out = capsys.readouterr().out
    e2e, ppll = result["e2e"]["losses"], result["ppll"]["losses"]
    assert len(e2e) == len(ppll) == 60
    # the same weights and the same first batch: the same first loss
    assert ppll[0] == pytest.approx(e2e[0], rel=1e-5)
    for losses in (e2e, ppll):
        assert sum(losses[-10:]) / 10 < 0.8 * losses[0], f"did not learn: {losses}\n{out}"
    assert len(result["ppll"]["cuts"]) == 1
    assert f"{1:>5} {e2e[0]:>11.4f} {ppll[0]:>9.4f}" in out and f"{60:>5} {e2e[-1]:>11.4f} {ppll[-1]:>9.4f}" in out
