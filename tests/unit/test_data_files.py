"""Prompt, preference and demonstration data from the files users bring: every format gives the
same rows, verl's and OpenRLHF's layouts work as they are, malformed rows are counted by reason,
mixtures follow their weights, and ``rayrlhf data inspect`` shows the ids a generator samples after."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.data.offline_data import read_demonstrations, read_preferences
from actors.data.tables import read_table
from actors.data.tasks import FileKeys, file_rows, prompt_token_ids, weighted_counts
from cluster.config import UserError
from cluster.config.loading import load_config
from cluster.data.sources import prompt_sets

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(6)]


def _write_all_formats(tmp_path):
    """The same rows as JSONL, a JSON array, JSON Lines named .json, Parquet, CSV, a folder of
    two Parquet shards, a datasets folder and a DatasetDict folder."""
    import datasets

    out = {}
    out["jsonl"] = tmp_path / "a.jsonl"
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out["json"] = tmp_path / "a.json"
    out["json"].write_text(json.dumps(ROWS))
    out["json_lines"] = tmp_path / "lines.json"
    out["json_lines"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out["parquet"] = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), out["parquet"])
    out["csv"] = tmp_path / "a.csv"
    out["csv"].write_text(
        "prompt,answer,level\n" + "".join(f'"{r["prompt"]}",{r["answer"]},{r["level"]}\n' for r in ROWS)
    )
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), shards / "part-000.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), shards / "part-001.parquet")
    out["folder"] = shards
    out["dataset"] = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(out["dataset"]))
    dd = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(dd))
    out["dataset_dict"] = dd
    return out


def test_every_format_gives_the_same_rows(tmp_path):
    for name, path in _write_all_formats(tmp_path).items():
        ps = file_rows(str(path), "")
        assert [(r["prompt"], r["answer"]) for r in ps.rows] == [(r["prompt"], r["answer"]) for r in ROWS], name
        assert str(ps.rows[1]["meta"]["level"]) == "1", name  # other columns reach the reward as meta
        assert ps.skipped == {}, name
    test_split = file_rows(f"{tmp_path / 'dd'}#test", "")
    assert [r["prompt"] for r in test_split.rows] == [r["prompt"] for r in ROWS[:2]]


def test_unreadable_sources_are_one_clear_error(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match="not found"):
        read_table(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="unsupported"):
        read_table(tmp_path / "x.txt")
    with pytest.raises(ValueError, match="no .jsonl"):
        (tmp_path / "empty").mkdir()
        read_table(tmp_path / "empty")
    (tmp_path / "a.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="is one file"):
        read_table(f"{tmp_path / 'a.jsonl'}#train")
    (tmp_path / "arr.json").write_text('{"rows": 1}')
    with pytest.raises(ValueError, match="list of row objects"):
        read_table(tmp_path / "arr.json")


def test_verl_layout_works_as_it_is_and_bad_rows_are_counted(tmp_path):
    good = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Q{i}? Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(4)
    ]
    bad = [
        {
            "data_source": "x",
            "prompt": [{"role": "user", "content": "  "}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"split": "train", "index": 9},
        },
        {
            "data_source": "x",
            "prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"split": "train", "index": 10},
        },
        {
            "data_source": "x",
            "prompt": None,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"split": "train", "index": 11},
        },
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(good + bad), path)
    ps = file_rows(str(path), "Answer with just the final answer.")
    assert [r["answer"] for r in ps.rows] == ["0", "1", "2", "3"]
    r = ps.rows[2]
    assert r["prompt"] == "Q2? Let's think step by step."  # chat-message prompts are used as they are
    assert r["meta"]["messages"] == good[2]["prompt"]
    assert r["meta"]["data_source"] == "openai/gsm8k" and r["meta"]["extra_info"]["index"] == 2
    assert ps.skipped == {"empty_or_malformed_prompt": 3}


def test_openrlhf_keys_and_an_explicit_answer_key(tmp_path):
    path = tmp_path / "o.jsonl"
    lines = [{"input": "Say hi", "label": "hi"}, {"input": "Say yo"}, {"input": 3, "label": "x"}, "not json"]
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    ps = file_rows(str(path), "", FileKeys(prompt="input", answer="label"))
    assert [(r["prompt"], r["answer"]) for r in ps.rows] == [("Say hi", "hi")]
    assert ps.skipped == {"missing_answer": 1, "empty_or_malformed_prompt": 1, "malformed_row": 1}
    # No answer key named: a row without any answer column trains on rewards that need none.
    auto = file_rows(str(path), "", FileKeys(prompt="input"))
    assert [(r["prompt"], r["answer"]) for r in auto.rows] == [("Say hi", "hi"), ("Say yo", "")]


def test_prompt_ids_are_the_chat_templates_own(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    want = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    got = prompt_token_ids(tok, "2+2?", {"messages": messages}, system_prompt="ignored: the row has its own")
    assert tok.decode(got) == "".join(want)
    plain = prompt_token_ids(tok, "2+2?", {}, system_prompt="Be brief.")
    assert plain == got
    raw = prompt_token_ids(tok, "2+2?", {}, chat_template=False)
    assert raw == list(tok.encode("2+2?", add_special_tokens=True)) and raw != got
    with pytest.raises(ValueError, match="chat template"):
        prompt_token_ids(tok, "2+2?", {"messages": messages}, chat_template=False)


@pytest.mark.parametrize(
    "total,weights,want",
    [(10, [1, 1], [5, 5]), (10, [3, 1], [8, 2]), (7, [1, 1, 1], [3, 2, 2]), (0, [1, 2], [0, 0]), (5, [0.5], [5])],
)
def test_weighted_counts_hand_values(total, weights, want):
    assert weighted_counts(total, weights) == want


def test_weighted_counts_sum_and_stay_within_one_of_the_exact_share():
    import random

    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.uniform(0.1, 5) for _ in range(rng.randint(1, 6))]
        total = rng.randint(0, 500)
        counts = weighted_counts(total, weights)
        assert sum(counts) == total
        for c, w in zip(counts, weights):
            assert abs(c - total * w / sum(weights)) < 1


def _cfg(tmp_path, **data):
    return load_config(
        overrides=[f"data.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in data.items()]
        + ["model.path=tiny"]
    )


def test_a_mixture_follows_its_weights_and_tags_each_rows_source(tmp_path):
    a = tmp_path / "alpha.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"alpha {i}", "answer": "1"}) + "\n" for i in range(100)))
    mix = [{"task": str(a), "weight": 3}, {"task": "basic_arithmetic", "weight": 1, "name": "arith"}]
    cfg = _cfg(tmp_path, mix=mix, train_size=40, eval_size=8)
    train, held, described = prompt_sets(cfg)
    sources = [r["meta"]["data_source"] for r in train.rows]
    assert sources.count("alpha") == 30 and sources.count("arith") == 10
    assert sorted(r["meta"]["data_source"] for r in held.rows) == ["alpha"] * 6 + ["arith"] * 2
    assert not {r["prompt"] for r in train.rows} & {r["prompt"] for r in held.rows}
    assert sources != sorted(sources)  # interleaved, not one source after the other
    assert "alpha.jsonl (30)" in described and "basic_arithmetic (10)" in described


def test_held_out_from_its_own_file(tmp_path):
    train_file, eval_file = tmp_path / "t.parquet", tmp_path / "e.jsonl"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i}", "answer": "1"} for i in range(20)]), train_file)
    eval_file.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "1"}) + "\n" for i in (3, 4, 50)))
    cfg = _cfg(tmp_path, task=str(train_file), eval_task=str(eval_file), eval_size=3, instruction="")
    train, held, _ = prompt_sets(cfg)
    assert [r["prompt"] for r in held.rows] == ["p3", "p4", "p50"]
    assert len(train) == 18 and not {"p3", "p4"} & {r["prompt"] for r in train.rows}


def test_a_bad_source_is_one_line(tmp_path):
    with pytest.raises(UserError, match="data.task: data file or folder not found"):
        prompt_sets(_cfg(tmp_path, task=str(tmp_path / "nope.parquet")))
    with pytest.raises(UserError, match=r"data.mix\[no_such_task\]"):
        prompt_sets(_cfg(tmp_path, mix=[{"task": "no_such_task"}]))


def test_preferences_and_demonstrations_from_every_layout(tmp_path):
    import datasets

    trl = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        }
        for i in range(3)
    ]
    datasets.Dataset.from_list(trl).save_to_disk(str(tmp_path / "prefs"))
    (tmp_path / "p.csv").write_text("prompt,chosen,rejected\nq9,yes,no\nq10,same,same\n")
    prefs = read_preferences(f"{tmp_path / 'prefs'},{tmp_path / 'p.csv'}")
    assert [r["prompt"][-1]["content"] for r in prefs.rows] == ["q0", "q1", "q2", "q9"]
    assert [r["index"] for r in prefs.rows] == [0, 1, 2, 3] and prefs.skipped == {"identical_pair": 1}
    (tmp_path / "d1.json").write_text(json.dumps([{"prompt": "a", "response": "b"}]))
    (tmp_path / "d2.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}) + "\n"
    )
    demos = read_demonstrations([str(tmp_path / "d1.json"), str(tmp_path / "d2.jsonl")])
    assert len(demos.rows) == 2 and "response" in demos.rows[0] and "messages" in demos.rows[1]


def test_data_inspect_shows_the_ids_and_the_skips_a_run_applies(tmp_path, tiny_model_path, capsys):
    from transformers import AutoTokenizer

    from cluster.cli import main

    path = tmp_path / "o.jsonl"
    rows = [{"question": f"What is {i}+1?", "label": str(i + 1)} for i in range(5)]
    rows += [{"question": "word " * 200, "label": "0"}, {"label": "3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    code = main(
        [
            "data",
            "inspect",
            str(path),
            "--json",
            "--set",
            "model.path=tiny",
            "--set",
            "data.prompt_key=question",
            "--set",
            "data.answer_key=label",
            "--set",
            "data.eval_size=0",
            "--set",
            "model.max_prompt_tokens=64",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["skipped_at_load"] == {"empty_or_malformed_prompt": 1, "malformed_row": 1}
    train = report["splits"]["train"]
    assert train["prompt_too_long"] == 1 and len(train["rows"]) == 6
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for r in train["rows"]:
        assert r["ids"] == prompt_token_ids(tok, r["prompt"], {})
        assert (r["skipped"] == "prompt_too_long") == (r["tokens"] > 64)
    assert main(["data", "inspect", str(tmp_path / "missing.jsonl"), "--set", "model.path=tiny"]) == 2
    assert "not found" in capsys.readouterr().err


def test_data_inspect_shows_pairs_and_demonstrations_as_the_learners_get_them(tmp_path, tiny_model_path, capsys):
    from transformers import AutoTokenizer

    from actors.data.offline_data import encode_pairs, read_preferences
    from cluster.cli import main

    prefs = tmp_path / "p.csv"
    prefs.write_text(
        "prompt,chosen,rejected\n"
        + "".join(f"q{i},good {i},bad {i}\n" for i in range(6))
        + "q9,"
        + "long " * 80
        + ",x\n"
    )
    common = ["--set", "model.path=tiny", "--set", "data.eval_size=0", "--set", "model.max_new_tokens=16", "--json"]
    assert (
        main(["data", "inspect", str(prefs), "--set", "run.algorithm=dpo", "--set", "dpo.pairs_per_step=2", *common])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    part = report["splits"]["train"]
    assert report["kind"] == "preferences" and part["too_long"] == 1 and len(part["rows"]) == 12
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = read_preferences(str(prefs)).rows
    from actors.data.offline_data import split_rows

    train, _ = split_rows(rows, 0, 0)
    exp, _ = encode_pairs(train, tok, max_prompt_tokens=256, max_response_tokens=16)
    for i, r in enumerate(part["rows"]):
        keep = exp.attention_mask[i].bool()
        assert r["ids"] == exp.input_ids[i][keep].tolist()
        assert r["trained"] == exp.response_mask[i][keep].tolist()
        assert r["score"] == (1.0 if i % 2 == 0 else 0.0)
    demos = tmp_path / "d.jsonl"
    demos.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i}"}) + "\n" for i in range(3)))
    assert main(["data", "inspect", str(demos), "--set", "run.algorithm=sft", *common[:-1]]) == 0
    text = capsys.readouterr().out
    assert "demonstrations rows" in text and "⟦" in text


def test_a_folder_of_splits_trains_on_its_train_files_only(tmp_path):
    folder = tmp_path / "gsm8k"
    (folder / "data").mkdir(parents=True)
    (folder / ".ipynb_checkpoints").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), folder / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), folder / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), folder / ".ipynb_checkpoints" / "train-checkpoint.parquet")
    (folder / "dataset_info.json").write_text("{}")
    assert [r["prompt"] for r in file_rows(str(folder), "").rows] == [r["prompt"] for r in ROWS[:4]]
    assert [r["prompt"] for r in file_rows(f"{folder}#test", "").rows] == [r["prompt"] for r in ROWS[4:]]
    with pytest.raises(ValueError, match="no 'validation' files"):
        read_table(f"{folder}#validation")


def test_a_text_prompts_own_messages_column_is_not_taken_for_the_prompt(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    path = tmp_path / "chat.jsonl"
    row = {
        "prompt": "2+2?",
        "answer": "4",
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    }
    path.write_text(json.dumps(row) + "\n")
    r = file_rows(str(path), "Be brief.").rows[0]
    assert "messages" not in r["meta"] and r["meta"]["source_messages"] == row["messages"]
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert prompt_token_ids(tok, r["prompt"], r["meta"]) == prompt_token_ids(tok, "2+2? Be brief.", {})


def test_your_own_prompts_go_in_as_written_unless_an_instruction_is_set(tmp_path, capsys):
    from cluster.cli import main

    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"prompt": f"Name a colour ({i}).", "answer": "red"}) + "\n" for i in range(40)))
    mix = [{"task": str(own), "weight": 1}, {"task": "basic_arithmetic", "weight": 1}]
    train, _, _ = prompt_sets(_cfg(tmp_path, mix=mix, train_size=32, eval_size=2))
    by_source = {r["meta"]["data_source"]: r["prompt"] for r in train.rows}
    assert by_source["own"].endswith(").") and by_source["basic_arithmetic"].endswith(
        "Answer with just the final answer."
    )
    train, _, _ = prompt_sets(_cfg(tmp_path, mix=mix, train_size=32, eval_size=2, instruction="Be brief."))
    assert all(r["prompt"].endswith("Be brief.") for r in train.rows)
    assert main(["data", "inspect", str(own), "--set", "model.path=tiny", "--set", "data.eval_size=2"]) == 0
    assert f"no instruction appended to {own}'s prompts" in capsys.readouterr().out
    assert (
        main(
            [
                "data",
                "inspect",
                str(own),
                "--set",
                "model.path=tiny",
                "--set",
                "data.eval_size=2",
                "--set",
                "data.instruction=Be brief.",
            ]
        )
        == 0
    )
    assert f"instruction appended to {own}'s text prompts: 'Be brief.'" in capsys.readouterr().out
