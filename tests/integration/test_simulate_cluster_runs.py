"""What the simulator predicts for a cluster: tokens per second of a causal LM, the bubble and its fill/drain share
against hand-computed schedules, and the memory each device holds."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ppll_compile
from ppll_compile.plans.plan import Plan
from ppll_compile.simulation.simulate import simulate
from tests.helpers import quiet

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.fixture(scope="module")
def llama_plan() -> Plan:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with quiet():
        return ppll_compile.plan(LlamaForCausalLM(config), 2, example_kwargs={"input_ids": ids})


# ---- tokens per second ----------------------------------------------------------------------------------

def test_a_causal_lm_reports_tokens_per_second_as_samples_times_the_sequence_length(llama_plan):
    sim = simulate(llama_plan, steps=8)
    assert llama_plan.inputs[0].shape == (2, 16) and llama_plan.inputs[0].dtype == "int64"
    assert sim.sequence_length == 16
    assert sim.token_throughput == sim.throughput * 16
    summary = sim.table().splitlines()[-1]
    assert f"throughput {sim.throughput:.1f} samples/s (plan predicts {sim.predicted:.1f}), " \
           f"{sim.throughput * 16:.1f} tokens/s  step time " in summary
    d = json.loads(json.dumps(sim.to_dict()))
    assert (d["sequence_length"], d["token_throughput"]) == (16, sim.throughput * 16)
