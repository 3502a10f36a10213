"""The trained model's files: a safetensors file streamed stage by stage (the package's own bytes), a sharded save
(one file per stage and the index ``from_pretrained`` reads), the stages handed on one by one, and bad targets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import ppll_compile
from tests.helpers import assert_equal_states_unordered, sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

INDEX = "model.safetensors.index.json"


@pytest.mark.slow
def test_a_sharded_llama_loads_with_from_pretrained(tmp_path):
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)]
    data = [({"input_ids": x}, torch.cat([x[:, 1:], torch.full((2, 1), -100)], 1)) for x in ids]
    compiled = ppll_compile.compile(model, 3, example_kwargs=data[0][0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with compiled.trainer(optimizer=sgd) as trainer:
        for x, y in data:
            trainer.step(x, y)
        folder = trainer.save_model(tmp_path / "llama", sharded=True)
    model.config.save_pretrained(folder)
    loaded = tf.LlamaForCausalLM.from_pretrained(folder)
    ref = model.state_dict()
    assert_equal_states_unordered(loaded.state_dict(), ref)
    assert any(not torch.equal(ref[k], before[k]) for k in ref)  # trained
    index = json.loads((folder / INDEX).read_text())
    assert len(set(index["weight_map"].values())) == 3
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids[0]).logits, model.eval()(ids[0]).logits, rtol=0, atol=0)


_KILLED_WRITER = """
import os, sys, time, warnings
import torch, ppll_compile
from ppll_compile.runtime.checkpoint import model_files
warnings.simplefilter("ignore")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 4))
compiled = ppll_compile.compile(model, 2, example_inputs=(torch.randn(4, 8),))
trainer = compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="sequential")

def stuck(self):  # the data is written: wait here, before the rename, until killed
    print("writing", flush=True)
    time.sleep(600)
model_files.TempFile.commit = stuck
trainer.save_model(sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_save_model_killed_midway_leaves_a_temporary_file_the_next_save_removes(tmp_path):
    """A process killed inside ``save_model`` leaves its hidden temporary file; a save while it is alive leaves it
    alone (its writer holds it), the first save after the kill removes it."""
    target = tmp_path / "model.pt"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                             cwd=tmp_path)
    try:
        assert child.stdout.readline() == "writing\n"
        temps = [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.pt.tmp-")]
        assert len(temps) == 1
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 4))
        compiled = ppll_compile.compile(model, 2, example_inputs=(torch.randn(4, 8),))
        trainer = compiled.trainer(optimizer=sgd, runtime="sequential")
        trainer.save_model(target)  # the writer is alive: its file stays
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([temps[0], "model.pt"])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert (tmp_path / temps[0]).is_file()  # what the killed write left
    trainer.save_model(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    assert set(torch.load(target, weights_only=True)) == set(model.state_dict())
    assert not os.path.exists(tmp_path / temps[0])
