"""A new algorithm is its learner file, its recipe file (here a reused recipe's run), its config
section and one registration each: a toy algorithm written into a temporary package, outside
this repository, runs through the config, the role declaration, the resource check, the dry run
and the learner workers' own builder without a line of the framework changed. Without its
registration the run stops in one line naming the registered algorithms."""

import sys
import textwrap

import pytest
import torch

from cluster.config import ConfigError
from cluster.config.loading import load_config
from tests.helpers.factories import experience, grouped_batch, tiny_lm

TOY_FILES = {
    "__init__.py": '''
        """The toy algorithm's registrations (named in run.plugins)."""
        from cluster.recipes import register_recipe
        from learners.base import register_learner

        register_learner("toy", "{pkg}.learner:ToyLearner")
        register_recipe("toy", "{pkg}.recipe")
    ''',
    "learner.py": '''
        """SFT's update, with the toy section's weight reported (what reaches the learner)."""
        from learners.sft import SFTLearner


        class ToyLearner(SFTLearner):
            name = "toy"
            config_section = "toy"

            def train_step(self, batch):
                return {**super().train_step(batch), "toy/weight": self.hp.weight}
    ''',
    "recipe.py": '''
        """The toy recipe: SFT's run and data, its own roles, section and checks."""
        from cluster.config import Section
        from cluster.recipes import Recipe, RoleSet, reference_where
        from cluster.recipes.sft import load_data, run  # noqa: F401  (the reused recipe)


        class ToySection(Section):
            weight: float = 1.0
            with_reference: bool = False


        def roles(cfg):
            return RoleSet(scorer=False, reference=reference_where(cfg, cfg.section("toy").with_reference))


        def check(cfg):
            return [(cfg.section("toy").weight >= 0, "toy.weight must be >= 0")]


        RECIPE = Recipe(name="toy", learner="toy", section="toy", roles=roles, check=check,
                        batch=lambda cfg: (cfg.sft.examples_per_step, "demonstrations"), section_model=ToySection)
    ''',
}


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """The toy package on the import path; every registration it makes is undone afterwards."""
    from cluster import recipes
    from learners import base

    pkg = f"toyalgo_{tmp_path.name.replace('-', '_')}"
    (tmp_path / pkg).mkdir()
    for name, text in TOY_FILES.items():
        (tmp_path / pkg / name).write_text(textwrap.dedent(text.replace("{pkg}", pkg)).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    recipes.unregister_recipe("toy")
    base.unregister_learner("toy")
    for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
        del sys.modules[mod]


def test_a_toy_algorithm_in_a_package_of_its_own_runs_through_the_framework(toy_package, tiny_model_path, capsys):
    from cluster.cli import main
    from cluster.roles.learner_spec import learner_spec
    from cluster.roles.learner_worker import build_learner
    from cluster.roles.resources import role_requests
    from learners.training.distributed import default_collective

    sets = [f"run.plugins={toy_package}", "run.algorithm=toy", "toy.weight=0.5", f"model.path={tiny_model_path}"]
    cfg = load_config(overrides=sets)
    assert cfg.section("toy").weight == 0.5 and cfg.to_dict()["toy"] == {"weight": 0.5, "with_reference": False}
    # Its roles, declared once, are what the resource check asks for.
    assert [r.role for r in role_requests(cfg)] == ["generator", "learner"]
    with_ref = load_config(overrides=[*sets, "toy.with_reference=true"])
    assert [r.role for r in role_requests(with_ref)] == ["generator", "reference", "learner"]
    # Its own checks and its section's keys are enforced like the built-in ones.
    with pytest.raises(ConfigError, match="toy.weight must be >= 0"):
        load_config(overrides=[*sets, "toy.weight=-1"])
    with pytest.raises(
        ConfigError, match="unknown config key 'toy.wieght' in section 'toy'; valid keys: weight, with_reference"
    ):
        load_config(overrides=[*sets, "toy.wieght=1"])
    assert main(["train", "--dry-run", *sum((["--set", s] for s in sets), [])]) == 0
    assert "toy:\n  weight: 0.5" in capsys.readouterr().out
    # The learner workers build it from the spec; its update is SFT's on the same batch.
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, list(range(4)), seed=3)
    batch = experience(lm, ids, att, rm, [0.0] * 4, groups=list(range(4)), ref_shift=None)
    toy = build_learner(learner_spec(cfg, tiny_model_path, 0), default_collective())
    sft = build_learner(
        learner_spec(load_config(overrides=[f"model.path={tiny_model_path}", "run.algorithm=sft"]), tiny_model_path, 0),
        default_collective(),
    )
    metrics = toy.train_step(batch)
    assert metrics["toy/weight"] == 0.5 and metrics["loss/total"] == sft.train_step(batch)["loss/total"]
    for (name, a), (_, b) in zip(toy.model.named_parameters(), sft.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_without_its_registration_the_run_stops_in_one_line_naming_the_registered_algorithms():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["run.algorithm=toy"])
    assert str(e.value) == "run.algorithm must be one of dpo, ppo, qlearn, reward_model, sft, got 'toy'"
    with pytest.raises(ConfigError, match="run.plugins: cannot import 'no_such_plugin'"):
        load_config(overrides=["run.plugins=no_such_plugin", "run.algorithm=toy"])
