"""A mixture-of-experts checkpoint is a model folder that vLLM and transformers load as it is: a
learner with LoRA on the attention and on every expert saves it merged, in the per-expert layout,
and a fresh vLLM engine on that folder, and transformers, give the learner's log-probs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.factories import make_learner

LORA = {
    "r": 4,
    "alpha": 8.0,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


@pytest.fixture(scope="module")
def saved(tiny_moe_path, tmp_path_factory):
    """(learner, checkpoint folder): the adapters moved (peft starts B at 0), then saved."""
    ln = make_learner(tiny_moe_path, lora=LORA)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ln.model.lm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    folder = ln.save(tmp_path_factory.mktemp("moe-ckpt") / "ckpt", tokenizer_from=tiny_moe_path)
    return ln, folder


def test_a_merged_expert_lora_checkpoint_loads_in_vllm_and_transformers(saved, tiny_moe_path):
    from transformers import AutoModelForCausalLM

    from actors.rollout.generator import Generator
    from tests.helpers.engines import engine_config

    ln, folder = saved
    ids = [1, 5, 9, 30, 40, 41, 7, 12]
    want = ln.probe_logprobs(ids)
    base = make_learner(tiny_moe_path).probe_logprobs(ids)
    assert max(abs(a - b) for a, b in zip(want, base)) > 1e-3  # the adapters changed the model
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    lp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1].double(), -1)
    assert lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist() == pytest.approx(want, abs=1e-4)
    gen = Generator(engine_config(str(folder), 256))
    try:
        assert gen.probe_logprobs(ids) == pytest.approx(want, abs=1e-4)
    finally:
        gen.close()
