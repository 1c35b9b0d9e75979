"""model.dropout: residual dropout on each decoder layer's attention and MLP outputs, in train
mode only — eval passes see the whole model, a dropped branch output is zero or scaled by
1/(1-p), the learners receive it; PPO refuses it."""

import pytest
import torch

from cluster.config import ConfigError
from cluster.config.loading import load_config
from learners.training.modeling import add_residual_dropout, decoder_layers


def _lm(path):
    from transformers import AutoModelForCausalLM

    from learners.training.attention import register

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=register())


def test_eval_passes_see_the_whole_model_and_train_passes_drop(tiny_model_path):
    plain, dropped = _lm(tiny_model_path), _lm(tiny_model_path)
    assert add_residual_dropout(dropped, 0.3) == len(decoder_layers(dropped)) > 0
    ids = torch.arange(5, 25).unsqueeze(0)
    plain.eval(), dropped.eval()
    torch.testing.assert_close(dropped(ids).logits, plain(ids).logits, rtol=0, atol=0)
    dropped.train()
    torch.manual_seed(0)
    a = dropped(ids).logits
    torch.manual_seed(1)
    b = dropped(ids).logits
    assert not torch.allclose(a, b) and not torch.allclose(a, plain(ids).logits)
    assert add_residual_dropout(_lm(tiny_model_path), 0.0) == 0


def test_a_dropped_branch_is_zero_or_scaled_by_the_keep_probability(tiny_model_path):
    lm = _lm(tiny_model_path)
    layer = decoder_layers(lm)[0]
    x = torch.randn(2, 7, lm.config.hidden_size)
    whole = layer.mlp(x)
    add_residual_dropout(lm, 0.5)
    layer.train()
    out = layer.mlp(x)
    kept = out != 0
    torch.testing.assert_close(out[kept], whole[kept] / 0.5)
    assert 0.3 < kept.float().mean() < 0.7  # about half of the entries survive
    layer.eval()
    torch.testing.assert_close(layer.mlp(x), whole)


def test_ppo_refuses_dropout_and_the_learners_receive_it(tiny_model_path):
    with pytest.raises(ConfigError, match="model.dropout is for sft"):
        load_config(overrides=["model.dropout=0.1"])
    from cluster.roles.learner_spec import learner_spec

    cfg = load_config(overrides=["run.algorithm=sft", "model.dropout=0.1"])
    assert learner_spec(cfg, tiny_model_path, 0).context.dropout == 0.1


def test_no_grad_passes_in_train_mode_see_the_whole_model(tiny_model_path):
    """The learners' old and reference passes run under no_grad while the model is in train mode
    (DPO's LoRA reference with the adapter off): dropout must not reach them."""
    plain, dropped = _lm(tiny_model_path), _lm(tiny_model_path)
    add_residual_dropout(dropped, 0.5)
    dropped.train(), plain.eval()
    ids = torch.arange(5, 25).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(dropped(ids).logits, plain(ids).logits, rtol=0, atol=0)
