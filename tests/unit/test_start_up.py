"""A run's start-up costs: role processes start with a lighter cyclic GC (actors/start_up.py), set
as the job's Ray setup hook unless the job brings its own; the learner group starts no Ray Data
actor it does not use."""

import subprocess
import sys

from actors.start_up import GEN0_THRESHOLD, SETUP_HOOK


def _in_fresh_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_lighter_gc_raises_only_generation_0s_threshold_and_never_lowers_it():
    got = _in_fresh_python("import gc; from actors.start_up import lighter_gc; lighter_gc(); print(gc.get_threshold())")
    assert got == f"({GEN0_THRESHOLD}, 10, 10)"
    got = _in_fresh_python(
        "import gc; gc.set_threshold(50000, 3, 4); from actors.start_up import lighter_gc; "
        "lighter_gc(); print(gc.get_threshold(), gc.isenabled())"
    )
    assert got == "(50000, 3, 4) True"


def test_freeze_imports_collects_garbage_first_and_freezes_the_rest():
    got = _in_fresh_python(
        "import gc, weakref\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; dead = weakref.ref(a); del a\n"  # a cycle: only the collector frees it
        "kept = Node()\n"
        "from actors.start_up import freeze_imports; freeze_imports()\n"
        "print(dead() is None, gc.get_freeze_count() > 0, gc.is_tracked(kept))"
    )
    assert got == "True True True"


def test_the_job_runtime_env_sets_the_hook_unless_the_job_has_one(monkeypatch):
    from ray._private import ray_constants

    from cluster.connection import job_runtime_env

    monkeypatch.delenv(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR, raising=False)
    env_vars = {"OMP_NUM_THREADS": "2"}
    env = job_runtime_env(env_vars)
    assert env == {"env_vars": {"OMP_NUM_THREADS": "2"}, "worker_process_setup_hook": SETUP_HOOK}
    env["env_vars"]["X"] = "1"
    assert env_vars == {"OMP_NUM_THREADS": "2"}  # a copy
    assert job_runtime_env(env_vars, lighter_gc=False) == {"env_vars": {"OMP_NUM_THREADS": "2"}}
    # A job submitted with a setup hook of its own (Ray refuses a second, different one).
    monkeypatch.setenv(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR, "users.module.hook")
    assert job_runtime_env(env_vars) == {"env_vars": {"OMP_NUM_THREADS": "2"}}


def test_the_hook_is_importable_by_its_name():
    from ray._common.utils import load_class  # what Ray imports the hook with

    assert load_class(SETUP_HOOK).__name__ == "lighter_gc"


def test_the_learner_group_starts_ray_datas_manager_only_for_datasets():
    from ray.train import ScalingConfig
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from cluster.roles.learner_group import trainer_class

    def loop(config):
        pass

    def kinds(**datasets):
        trainer = trainer_class()(loop, scaling_config=ScalingConfig(num_workers=1), datasets=datasets or None)
        return {type(c) for c in trainer._create_default_callbacks()}

    assert DatasetsCallback not in kinds() and PlacementGroupCleanerCallback in kinds()
    assert DatasetsCallback in kinds(train=lambda: None)  # a run that passes datasets keeps it
