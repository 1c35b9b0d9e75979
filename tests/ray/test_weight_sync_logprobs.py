"""vLLM (in a Ray actor) and the trainer agree on log-probs, before and after a weight sync."""

import pytest
import ray
import torch

from cluster.config.role_settings import generator_config
from cluster.roles.workers import GeneratorWorker
from cluster.config.loading import load_config
from cluster.roles.weight_sync import pack
from learners.training.modeling import sequence_logprobs

pytestmark = pytest.mark.ray


def _trainer_logprobs(lm, exp):
    return sequence_logprobs(lm, exp.input_ids, exp.attention_mask, exp.response_mask)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_vllm_and_trainer_logprobs_agree_across_a_sync(ray_cluster, tiny_model_path, compiled):
    """Also with the engine compiled (rollout.compile): a load must reach the compiled model,
    whose CPU linear layers re-pack their weights after every load."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(
        overrides=[
            "model.generator_dtype=float32",
            "model.max_new_tokens=16",
            "model.max_prompt_tokens=64",
            "rollout.samples_per_prompt=2",
            f"rollout.compile={str(compiled).lower()}",
        ]
    )
    gen = ray.remote(GeneratorWorker).options(num_cpus=1).remote(generator_config(cfg, tiny_model_path))
    try:
        ray.get(gen.ready.remote())
        info = ray.get(gen.compilation.remote())
        assert info["compiled"] is compiled
        if compiled:
            assert info["mode"] != "NONE" and info["models_seen"] > 0 and info["dynamo_graphs"] > 0, info
        else:
            assert info["mode"] == "NONE" and info["models_seen"] == 0 and info["dynamo_graphs"] == 0, info
        rows = [{"prompt": f"What is {i} + {i + 1}?", "meta": {"question": str(i)}} for i in range(6)]

        lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        exp0, stats = ray.get(gen.generate.options(num_returns=2).remote(rows, list(range(6))))
        assert exp0.batch_size == 12 and stats["tokens"] == int(exp0.response_mask.sum())
        before = _trainer_logprobs(lm, exp0)
        mask = exp0.response_mask
        gap0 = (before - exp0.rollout_logprobs)[mask].abs().max().item()
        assert gap0 < 1e-4, gap0

        # A learner-side update: perturb every weight (the tied embedding too).
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in lm.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        sd = {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"}
        ref = ray.put(pack(sd, "float32", version=1))
        load_s = ray.get(gen.load_weights.remote([ref]))
        assert load_s > 0 and ray.get(gen.version.remote()) == 1

        # Same tokens, new weights: vLLM's prompt+response scoring must follow the sync.
        exp1, _ = ray.get(gen.generate.options(num_returns=2).remote(rows, list(range(6))))
        after = _trainer_logprobs(lm, exp1)
        gap1 = (after - exp1.rollout_logprobs)[exp1.response_mask].abs().max().item()
        assert gap1 < 1e-4, gap1
        assert exp1.policy_version == 1
        # And the sync really changed the policy: the old tokens score differently now.
        moved = (_trainer_logprobs(lm, exp0) - exp0.rollout_logprobs)[mask].abs().mean().item()
        assert moved > 1e-2, moved
    finally:
        ray.kill(gen)
