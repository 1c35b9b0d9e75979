"""A new advantage estimator, policy loss or preference loss is one decorated function: the
config accepts its name (and the schema lists it), the learner calls it, and an unknown name is
a one-line error naming the registered ones. Each test unregisters what it registered."""

import pytest
import torch
from pydantic import ValidationError

from cluster.config import DPOConfig, PPOConfig
from learners.objectives import advantages
from learners.objectives import policy_losses
from learners.objectives import preference_losses
from learners.objectives.advantages import (
    AdvantageInputs,
    Estimate,
    get_estimator,
    needs_group,
    register_estimator,
    unregister_estimator,
)
from learners.objectives.losses import policy_loss_clipped
from learners.objectives.policy_losses import get_policy_loss, policy_loss, register_policy_loss, unregister_policy_loss
from learners.objectives.preference_losses import (
    PreferenceInputs,
    preference_loss,
    register_preference_loss,
    unregister_preference_loss,
)
from tests.helpers.factories import experience, make_dpo_learner, make_learner, preference_batch, ragged_batch, tiny_lm


def _one_line_error(call, *parts: str) -> None:
    """``call()`` raises a ValueError (a config's: its field's message) of one line holding ``parts``."""
    with pytest.raises(ValueError) as info:
        call()
    msg = info.value.errors()[0]["msg"] if isinstance(info.value, ValidationError) else str(info.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg


def test_a_registered_estimator_is_accepted_and_gives_the_learners_advantages(tiny_model_path):
    seen: list[AdvantageInputs] = []

    @register_estimator("constant_half", needs_group=True)
    def constant_half(x: AdvantageInputs) -> Estimate:
        seen.append(x)
        zeros = torch.zeros_like(x.logprobs)
        return Estimate(0.5 * x.mask.float(), zeros, zeros)

    try:
        assert PPOConfig(advantage_estimator="constant_half").advantage_estimator == "constant_half"
        assert "constant_half" in PPOConfig.model_json_schema()["properties"]["advantage_estimator"]["enum"]
        assert needs_group("constant_half") and not needs_group("reinforce_pp")
        assert "constant_half" in advantages.GROUP_ESTIMATORS and "constant_half" in advantages.ESTIMATORS
        learner = make_learner(
            tiny_model_path, ppo={"advantage_estimator": "constant_half", "kl_coef": 0.0, "skip_zero_advantage": False}
        )
        assert not learner.use_critic
        lm = learner.model.lm
        ids, att, rm = ragged_batch(lm.config.vocab_size, b=4)
        metrics = learner.train_step(experience(lm, ids, att, rm, [1.0, 0.0, 0.5, 0.2], ref_shift=None))
        assert len(seen) == 1 and torch.equal(seen[0].scores, torch.tensor([1.0, 0.0, 0.5, 0.2]))
        assert metrics["advantage/mean"] == pytest.approx(0.5)
    finally:
        unregister_estimator("constant_half")
    assert "constant_half" not in advantages.ESTIMATORS
    known = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp")
    _one_line_error(
        lambda: PPOConfig(advantage_estimator="constant_half"),
        "ppo.advantage_estimator must be one of gae, grpo, dr_grpo, rloo, reinforce_pp; got 'constant_half'",
    )
    _one_line_error(lambda: get_estimator("sarsa"), "sarsa", *known)


def test_a_registered_policy_loss_is_accepted_and_trains(tiny_model_path):
    calls: list[str] = []

    @register_policy_loss("marked_ppo")
    def marked_ppo(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high=None, **kwargs):
        calls.append("marked_ppo")
        loss, stats = policy_loss_clipped(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high, **kwargs)
        return loss, {**stats, "clip_frac": torch.tensor(0.25)}

    try:
        assert get_policy_loss("marked_ppo") is marked_ppo
        assert "marked_ppo" in policy_losses.POLICY_LOSSES
        assert "marked_ppo" in PPOConfig.model_json_schema()["properties"]["policy_loss"]["enum"]
        learner = make_learner(tiny_model_path, ppo={"policy_loss": "marked_ppo", "kl_coef": 0.0})
        lm = learner.model.lm
        ids, att, rm = ragged_batch(lm.config.vocab_size, b=4)
        metrics = learner.train_step(experience(lm, ids, att, rm, [1.0, 0.0, 0.5, 0.2], ref_shift=None))
        assert calls and metrics["policy/clip_frac"] == pytest.approx(0.25)
    finally:
        unregister_policy_loss("marked_ppo")
    assert policy_losses.POLICY_LOSSES == ("ppo", "gspo", "cispo")
    _one_line_error(lambda: PPOConfig(policy_loss="marked_ppo"), "ppo.policy_loss must be one of ppo, gspo, cispo")
    z = torch.zeros(1, 2)
    _one_line_error(lambda: policy_loss("trpo", z, z, z, z, clip_eps=0.2), "'trpo'", "ppo, gspo, cispo")


def test_a_registered_preference_loss_is_accepted_and_trains(tiny_model_path):
    @register_preference_loss("constant_three")
    def constant_three(x: PreferenceInputs) -> torch.Tensor:
        return 0.0 * x.log_ratio() + 3.0

    try:
        assert DPOConfig(loss="constant_three").uses_reference
        assert "constant_three" in DPOConfig.model_json_schema()["properties"]["loss"]["enum"]
        assert "constant_three" in preference_losses.PREFERENCE_LOSSES
        pi = torch.tensor([-1.0, -2.0])
        assert preference_loss(pi, pi, pi, pi, kind="constant_three").tolist() == [3.0, 3.0]
        _one_line_error(lambda: preference_loss(pi, pi, kind="constant_three"), "needs the reference log-probs")
        batch = preference_batch(tiny_lm(tiny_model_path), 3, ref_shift=0.1)
        metrics = make_dpo_learner(tiny_model_path, dpo={"loss": "constant_three"}).train_step(batch)
        assert metrics["loss/total"] == pytest.approx(3.0)
    finally:
        unregister_preference_loss("constant_three")
    known = ("sigmoid", "ipo", "hinge", "robust", "simpo")
    assert preference_losses.PREFERENCE_LOSSES == known
    _one_line_error(lambda: DPOConfig(loss="constant_three"), "dpo.loss must be one of " + ", ".join(known))
    pi = torch.tensor([-1.0])
    _one_line_error(lambda: preference_loss(pi, pi, pi, pi, kind="kto"), "'kto'", *known)


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo")(lambda x: x)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo")(policy_loss_clipped)
    with pytest.raises(ValueError, match="already registered"):
        register_preference_loss("ipo")(lambda x: x)
