"""Bad fine-tuning data: each bad input is one TensorstowError naming the file, the line (JSONL,
1-based) or row (a `datasets` directory, 0-based) and the field, never a traceback and never
silently accepted; and exported files get the mode any new file gets."""
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from tensorstow import TensorstowError
from tensorstow.executor.examples import Examples, tokenize

V = 200  # the vocabulary of the pre-tokenized examples
GOOD = {"input_ids": [1, 2, 3]}


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(source: str, tokenizer=None) -> Examples:
    return Examples.load(source, seq=8, vocab=V, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.test_finetune import make_tokenizer
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_a_line_that_is_not_utf8_is_named_with_its_byte(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"input_ids": [1]}\n\n{"input_ids": [2], "note": "caf\xe9"}\n')
    with pytest.raises(TensorstowError, match=r"^\S*data.jsonl:3: not UTF-8 text \(byte 0xe9 at column 32\); "
                                              r"save the file as UTF-8$"):
        load(str(data))


@pytest.mark.parametrize("field", ["input_ids", "labels"])
@pytest.mark.parametrize("value, says", [
    ("1 2 3", "got a string"),
    (None, "got null"),
    (7, "got an integer"),
    ([1, [2, 3]], r"element 1 is \[2, 3\] \(a list\)"),
    ([1, 2, 3.0], r"element 2 is 3.0 \(a float\)"),
    ([1, 2, 2.5], r"element 2 is 2.5 \(a float\)"),
    ([True, 2, 3], r"element 0 is true \(a bool\)"),
    ([1, None, 3], r"element 1 is null"),
    ([10**30, 2, 3], r"element 0 is 1000000000000000000000000000000, outside int64"),
    ([1, -2**63 - 1, 3], r"element 1 is -9223372036854775809, outside int64"),
])
def test_token_ids_that_are_not_int64_integers_are_refused(tmp_path, field, value, says):
    bad = {"input_ids": [1, 2, 3], field: value}
    source = write_jsonl(tmp_path / "data.jsonl", [GOOD, bad])
    with pytest.raises(TensorstowError, match=rf"data.jsonl:2: {field} must be a list of integer token ids, {says}"):
        load(source)


def test_numpy_integers_are_token_ids():
    row = {"input_ids": np.array([1, 2], dtype=np.int32), "labels": [np.int64(-100), np.uint8(2)]}
    (ids, labels), = tokenize([("ds row 0", row)], None, -100, V)
    assert ids == [1, 2] and labels == [-100, 2] and all(type(t) is int for t in ids + labels)


@pytest.mark.parametrize("row, field, says", [
    ({"text": 12345}, "text", "an integer"),
    ({"text": None}, "text", "null"),
    ({"prompt": None, "completion": "b"}, "prompt", "null"),
    ({"prompt": "a", "completion": ["b"]}, "completion", "a list"),
])
def test_text_fields_that_are_not_strings_are_refused(tok, tmp_path, row, field, says):
    source = write_jsonl(tmp_path / "data.jsonl", [{"text": "the cat"}, {"text": "a dog"}, row])
    with pytest.raises(TensorstowError, match=rf"data.jsonl:3: {field} must be a string, got {says}$"):
        load(source, tok)


@pytest.mark.parametrize("row, says", [
    ({"input_ids": [1, 2, V]}, rf"input_ids holds token id {V}, outside the model's vocabulary \[0, {V}\)"),
    ({"input_ids": [1, -1, 2]}, rf"input_ids holds token id -1, outside the model's vocabulary \[0, {V}\)"),
    ({"input_ids": [1, 2, 3], "labels": [1, 2, V + 5]},
     rf"labels holds {V + 5}, neither the ignore index -100 nor in the model's vocabulary \[0, {V}\)"),
    ({"input_ids": [1, 2, 3], "labels": [-100, -1, 3]},
     rf"labels holds -1, neither the ignore index -100 nor in the model's vocabulary \[0, {V}\)"),
    ({"input_ids": [1, 2, 3], "labels": [1, 2]}, r"3 input_ids but 2 labels"),
    ({"question": "a"}, r"the example has keys \['question'\]: give input_ids"),
])
def test_an_out_of_vocabulary_id_or_label_names_its_line_and_row(tmp_path, row, says):
    with pytest.raises(TensorstowError, match=rf"data.jsonl:3: {says}"):
        load(write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, row]))
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    columns = {**GOOD, **row}  # a row lacking a column holds None in it
    datasets.Dataset.from_list([{c: r.get(c) for c in columns} for r in (GOOD, GOOD, row)]).save_to_disk(
        str(tmp_path / "ds"))
    with pytest.raises(TensorstowError, match=rf"ds row 2: {says}"):
        load(str(tmp_path / "ds"))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_datasets_directory_is_named(tmp_path, damage):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    d = tmp_path / "ds"
    datasets.Dataset.from_list([GOOD] * 50).save_to_disk(str(d))
    load(str(d))  # reads when whole
    arrow, = d.glob("*.arrow")
    if damage == "truncated":
        os.truncate(arrow, arrow.stat().st_size // 2)
    else:
        arrow.unlink()
    with pytest.raises(TensorstowError) as e:
        load(str(d))
    msg = str(e.value)
    assert msg.startswith(f"data {d}: cannot read the datasets directory (") and "\n" not in msg, msg
    assert msg.endswith("); it is damaged or was not written by save_to_disk: write it again"), msg
    assert damage == "truncated" or arrow.name in msg, msg


def test_exported_files_get_the_mode_of_any_new_file(tmp_path):
    pytest.importorskip("safetensors")
    from tensorstow.cli import main
    plan = tmp_path / "plan.json"
    assert main(["plan", "tests.fixtures.real_models:nano_gpt_dropout", "--hw", "lohan-rtx4090", "--batch", "2",
                 "--seq", "16", "--precision", "fp32", "--policy", "stronghold", "--gpu-mem", "400KB",
                 "-o", str(plan)]) == 0
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "1", "--state-dir", str(tmp_path / "s")]) == 0
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "out"), "--shard-size", "20KB"]) == 0
    umask = os.umask(0)
    os.umask(umask)
    files = sorted((tmp_path / "out").iterdir())
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}
