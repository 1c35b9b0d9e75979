"""The streamed source's file reader (``cluster/stream_reader.read_blocks``): every row in file
order, in blocks no larger than asked, each format as the in-memory readers see it."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.data.stream_reader import PromptFiles, read_blocks


def _rows(path, block_rows):
    blocks = list(read_blocks(str(path), block_rows))
    assert all(0 < b.num_rows <= block_rows for b in blocks)
    return blocks, [row for b in blocks for row in b.to_pylist()]


def test_parquet_rows_come_in_file_order_in_blocks_of_the_asked_size(tmp_path):
    path = tmp_path / "p.parquet"
    want = [{"prompt": f"q{i}", "answer": str(i)} for i in range(23)]
    pq.write_table(pa.Table.from_pylist(want), path, row_group_size=5)
    blocks, rows = _rows(path, 4)
    assert rows == want and len(blocks) >= 6


def test_csv_cells_stay_strings_a_bom_is_not_part_of_the_first_name_and_ragged_rows_do_not_stop_it(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(
        '\ufeffprompt,answer\nWhat is 5 + 2?,007\n"a, quoted",1.50\nshort\nlong,1,extra\n', encoding="utf-8"
    )
    blocks, rows = _rows(path, 3)
    assert rows == [
        {"prompt": "What is 5 + 2?", "answer": "007"},
        {"prompt": "a, quoted", "answer": "1.50"},
        {"prompt": "short", "answer": None},
        {"prompt": "long", "answer": "1"},
    ]
    assert all(b.schema == blocks[0].schema for b in blocks)  # the header's string columns in every block


def test_jsonl_lines_arrive_raw_blank_ones_dropped_broken_ones_kept_for_the_sampler_to_count(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": f"p{i}"}) for i in range(5)]
    path.write_text("\n".join(lines[:2] + ["", "{broken", "   "] + lines[2:]) + "\r\n", encoding="utf-8")
    blocks, rows = _rows(path, 2)
    assert [r["text"] for r in rows] == lines[:2] + ["{broken"] + lines[2:]
    assert len(blocks) == 3


def test_the_source_reads_each_file_in_a_task_of_its_own_in_the_given_order(tmp_path):
    files = []
    for k in range(3):
        files.append(tmp_path / f"{k}.jsonl")
        files[-1].write_text(json.dumps({"prompt": f"f{k}"}) + "\n")
    tasks = PromptFiles(list(reversed(files)), block_rows=8).get_read_tasks(parallelism=200)
    assert [t.metadata.input_files for t in tasks] == [(str(f),) for f in reversed(files)]
    assert [json.loads(b.to_pylist()[0]["text"])["prompt"] for t in tasks for b in t()] == ["f2", "f1", "f0"]
