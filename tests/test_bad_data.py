"""Bad fine-tuning data: each bad input is one TensorstowError naming the file, the line (JSONL,
1-based) or row (a `datasets` directory, 0-based) and the field, never a traceback and never
silently accepted; and exported files get the mode any new file gets."""
import json
import os
import re
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
    ({"input_ids": []}, r"input_ids is empty: give the example's token ids, or drop it$"),
    ({"input_ids": [1, 2, 3], "label": [-100, 2, 3]},  # else every token a label
     r"the pre-tokenized example has key label, not labels: rename the misspelt key$"),
    ({"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
     r"the pre-tokenized example's completion_mask says which tokens are labels, which tensorstow reads from labels"),
    ({"input_ids": [1, 2, 3], "attention_mask": [0, 1, 1]},
     r"attention_mask must be a 1 for each of the 3 input_ids \(every token of an example is attended to\): cut the "
     r"padding off input_ids, or drop the mask$"),
    ({"input_ids": [1, 2, 3], "attention_mask": [1, 1]}, r"attention_mask must be a 1 for each of the 3 input_ids"),
    ({"text": "a", "messages": [{"role": "user", "content": "a"}]}, r"the example has both messages and text"),
    ({"prompt": "a", "completion": "b", "text": "c"}, r"the example has both prompt and text"),
])
def test_an_out_of_vocabulary_id_or_label_names_its_line_and_row(tmp_path, row, says):
    """A bad example is one line naming its line (row) and what is wrong with it: never trained on as
    another form, with a misspelt key dropped, or with no tokens."""
    with pytest.raises(TensorstowError, match=rf"data.jsonl:3: {says}") as e:
        load(write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, row]))
    assert "\n" not in str(e.value)
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    columns = {**GOOD, **row}  # a row lacking a column holds None in it
    datasets.Dataset.from_list([{c: r.get(c) for c in columns} for r in (GOOD, GOOD, row)]).save_to_disk(
        str(tmp_path / "ds"))
    with pytest.raises(TensorstowError, match=rf"ds row 2: {says}"):
        load(str(tmp_path / "ds"))


@pytest.mark.parametrize("rows, fix", [
    ([{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}] * 2, "give labels other than the ignore index -100"),
    ([{"input_ids": [1, 2, 3], "labels": [1, -100, -100]}, {"input_ids": [4]}],  # a first label is no one's target
     "give labels other than the ignore index -100"),
    ([{"input_ids": list(range(1, 13)), "labels": [-100] * 10 + [11, 12]}],  # its labels past seq + 1
     "give labels other than the ignore index -100"),
    ([{"prompt": " ".join(["the cat sat on a mat"] * 4), "completion": " a dog"}],  # the completion past seq + 1
     "with --loss-on assistant the chat template must mark the assistant's tokens"),
])
def test_data_in_which_no_example_has_a_label_is_refused(request, tmp_path, rows, fix):
    """Of every form, as data of text without labels is: a run would take steps that update nothing."""
    tokenizer = None if all("input_ids" in r for r in rows) else request.getfixturevalue("tok")
    with pytest.raises(TensorstowError, match=rf"^data \S*data.jsonl: no example has a label within seq \+ 1 = 9 "
                                              rf"tokens \(first: \S*data.jsonl:1\); {fix}, and a longer --seq keeps "
                                              rf"more of each example$"):
        load(write_jsonl(tmp_path / "data.jsonl", rows), tokenizer)


def test_a_pretokenized_example_without_a_label_beside_labelled_ones_is_kept(tmp_path):
    """As it is given (a text example without one is left out); an attention_mask of ones is taken,
    and the other columns (the text or messages the ids were made from, which `ds.map(tokenize)`
    keeps, an id, token_type_ids) are left aside, as TRL leaves them: the ids are the example."""
    unlabelled = {"input_ids": [4, 5], "labels": [-100, -100], "attention_mask": [1, 1]}
    sourced = {"input_ids": [6, 7, 8], "text": "abc", "messages": [{"role": "user", "content": "abc"}], "id": 7,
               "token_type_ids": [0, 0, 0]}
    ex = load(write_jsonl(tmp_path / "data.jsonl", [GOOD, unlabelled, sourced]))
    assert len(ex) == 3 and ex.left_out == () and ex.notes == ()
    assert ex.ids[1, :2].tolist() == [4, 5] and set(ex.labels[1].tolist()) == {-100}
    assert ex.ids[2, :3].tolist() == [6, 7, 8] and ex.labels[2, :3].tolist() == [6, 7, 8]


@pytest.fixture(scope="module")
def nano_plan(tmp_path_factory):
    """A plan of a nanoGPT-style model (vocabulary 128, ignore index -1, as nanoGPT's)."""
    from tensorstow.cli import main
    plan = tmp_path_factory.mktemp("nano") / "plan.json"
    assert main(["plan", "tests.fixtures.real_models:nano_gpt_dropout", "--hw", "lohan-rtx4090", "--batch", "2",
                 "--seq", "16", "--precision", "fp32", "--policy", "stronghold", "--gpu-mem", "400KB",
                 "-o", str(plan)]) == 0
    return plan


@pytest.mark.parametrize("row, says", [
    ({"input_ids": [1, 2, 3], "label": [-1, 2, 3]}, r"data.jsonl:2: the pre-tokenized example has key label, not labels"),
    ({"input_ids": []}, r"data.jsonl:2: input_ids is empty"),
    ({"input_ids": [1, 2, 3], "labels": [-1, -1, -1]}, r"data \S*data.jsonl: no example has a label"),
])
def test_execute_refuses_bad_examples_in_one_line_before_any_step(nano_plan, tmp_path, capsys, row, says):
    from tensorstow.cli import main
    first = {"input_ids": [1, 2, 3], "labels": [-1, -1, -1]}
    data = write_jsonl(tmp_path / "data.jsonl", [first, row])
    capsys.readouterr()
    code = main(["execute", str(nano_plan), "--hw-mismatch", "ok", "--steps", "1", "--data", data,
                 "--state-dir", str(tmp_path / "s")])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("tensorstow: error: "), err
    assert re.search(says, err) and "step 1/" not in out, (out, err)


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


def test_evaluation_data_reads_a_dataset_dicts_held_out_split_never_train(tmp_path):
    """A `DatasetDict` directory: training data reads its train split, evaluation data its
    validation (else test) split; one with neither is refused rather than evaluated on train."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    from tensorstow.executor.examples import HELD_OUT
    rows = {name: [{"input_ids": [k + 1, k + 2, k + 3]}] * 4 for k, name in enumerate(["train", "test"])}
    d = tmp_path / "dict"
    datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in rows.items()}).save_to_disk(str(d))
    assert Examples.load(str(d), 4, 100).ids[0, :3].tolist() == [1, 2, 3]
    assert Examples.load(str(d), 4, 100, splits=HELD_OUT).ids[0, :3].tolist() == [2, 3, 4]
    only = tmp_path / "only-train"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows["train"])}).save_to_disk(str(only))
    with pytest.raises(TensorstowError, match=r"holds splits \['train'\], none of validation, test: pass the directory"):
        Examples.load(str(only), 4, 100, splits=HELD_OUT)


def test_an_empty_datasets_directory_is_one_line(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    d = tmp_path / "empty"
    datasets.Dataset.from_list([GOOD]).select([]).save_to_disk(str(d))
    with pytest.raises(TensorstowError, match="the datasets directory holds no rows"):
        load(str(d))
