"""`prepare --format preference`: TRL's three forms of a pair, tokenized as TRL 1.16's
DPOTrainer tokenizes them (its own `_prepare_dataset` is the oracle), cut to one shape, and
every record accounted for."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from dataset import prepare
from dataset.encode import IGNORE_INDEX
from dataset.loader import ShardLoader
from dataset.preference import extract_prompt, fit_pair, normalize_preference, tokenize_pair

SEQ_LEN = 64
STANDARD = {"prompt": "Care este reședința județului Brașov?", "chosen": " Brașov.", "rejected": " Sibiu."}
CONVERSATIONAL = {
    "prompt": [{"role": "system", "content": "Răspunde scurt."},
               {"role": "user", "content": "Ce râu trece prin Sibiu?"},
               {"role": "assistant", "content": "Cibinul."},
               {"role": "user", "content": "Și prin Cluj?"}],
    "chosen": [{"role": "assistant", "content": "Someșul Mic."}],
    "rejected": [{"role": "assistant", "content": "Mureșul."}],
}
IMPLICIT_TEXT = {"chosen": "Reședința județului Iași este Iași.", "rejected": "Reședința județului Iași este Vaslui."}
IMPLICIT_CHAT = {
    "chosen": [{"role": "user", "content": "Unde e Brașovul?"}, {"role": "assistant", "content": "În Transilvania."}],
    "rejected": [{"role": "user", "content": "Unde e Brașovul?"}, {"role": "assistant", "content": "În Oltenia."}],
}
RECORDS = [STANDARD, CONVERSATIONAL, IMPLICIT_TEXT, IMPLICIT_CHAT]


def trl_tokenized(tokenizer, records: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """TRL's DPOTrainer._prepare_dataset on the records, one form at a time (a dataset is of one
    form, as TRL reads it from its first example): (prompt_ids, chosen_ids, rejected_ids) each."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir="unused", max_length=None, report_to=[], dataset_num_proc=None)
    trainer = SimpleNamespace(_tokenizer=tokenizer)  # what _prepare_dataset reads of the trainer
    out = []
    for record in records:
        prepared = DPOTrainer._prepare_dataset(trainer, Dataset.from_list([record]), tokenizer, args, "train")[0]
        out.append((prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"]))
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_each_form_is_tokenized_as_trl_tokenizes_it(tokenizer):
    ours = [tokenize_pair(tokenizer, normalize_preference(record)) for record in RECORDS]
    assert ours == trl_tokenized(tokenizer, RECORDS)
    assert ours[0][1][-1] == ours[0][2][-1] == tokenizer.eos_token_id  # standard: each completion ends in EOS
    assert tokenizer.decode(ours[1][1]).startswith("Someșul Mic.")  # conversational: the answer, then its end


def test_the_implicit_prompt_is_trls_extract_prompt():
    from trl.data_utils import extract_prompt as trls

    cases = [("Iași este Iași.", "Iași este Vaslui."), ("ab", "abc"), ("x", "y"), ("a b", "a c"),
             (IMPLICIT_CHAT["chosen"], IMPLICIT_CHAT["rejected"])]
    for chosen, rejected in cases:
        expected = trls({"chosen": chosen, "rejected": rejected})
        assert extract_prompt(chosen, rejected) == (expected["prompt"], expected["chosen"], expected["rejected"])


def test_a_pair_is_cut_prompt_first_from_its_start_then_each_row_at_its_end():
    prompt, chosen, rejected = list(range(10)), [20, 21, 22], [30, 31, 32, 33, 34, 35]
    assert fit_pair(prompt, chosen, rejected, 16, 8) == ((prompt[2:], chosen, rejected[:6]), True)
    assert fit_pair(prompt, chosen, rejected, 12, 8) == ((prompt[2:], chosen, rejected[:4]), True)
    assert fit_pair(prompt[:4], chosen, rejected, 16, 8) == ((prompt[:4], chosen, rejected), False)
    with pytest.raises(Exception, match="no completion token within --seq-len 8"):
        fit_pair(prompt, chosen, rejected, 8, 8)


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records),
                    encoding="utf-8")
    return str(path)


BAD = [  # (record, the reason it is skipped with)
    ({"prompt": "Q?", "chosen": " Da.", "rejected": " Da."}, "chosen_equals_rejected"),
    ({"prompt": "Q?", "chosen": " ", "rejected": " Nu."}, "empty_completion"),
    ({"prompt": "Q?", "chosen": " Da."}, "missing_field"),
    ({"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "assistant", "content": "A"}],
      "rejected": "B"}, "wrong_type"),
    ({"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "user", "content": "A"}],
      "rejected": [{"role": "assistant", "content": "B"}]}, "bad_turn_order"),
    ('{"prompt": "unterminated', "malformed_json"),
]


def test_prepare_writes_pairs_as_trl_tokenizes_them_and_accounts_for_every_record(tokenizer, tiny_model_dir,
                                                                                    tmp_path, capsys):
    long_prompt = {"prompt": "Brașov " * 60 + "?", "chosen": " Da.", "rejected": " Nu."}
    standard = write_jsonl(tmp_path / "standard.jsonl", [STANDARD, IMPLICIT_TEXT, long_prompt, *[b for b, _ in BAD]])
    chats = write_jsonl(tmp_path / "chats.jsonl", [CONVERSATIONAL, IMPLICIT_CHAT])
    out = tmp_path / "pairs"
    args = ["--tokenizer", str(tiny_model_dir), "--seq-len", str(SEQ_LEN), "--out", str(out), "--quiet",
            "--eval-fraction", "0", "--input", standard, "--input", chats]

    assert prepare.main(args) == 2  # strict: each bad record named by its file and line
    err = capsys.readouterr().err
    for line in range(4, 4 + len(BAD)):
        assert f"{standard}:{line}: " in err
    assert not out.exists()

    assert prepare.main([*args, "--skip-invalid"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    stats = json.loads((out / "stats.json").read_text())
    assert manifest["phase"] == "preference" and manifest["max_prompt_len"] == SEQ_LEN // 2
    assert manifest["detected_formats"] == {standard: "preference", chats: "preference"}
    kept = [STANDARD, IMPLICIT_TEXT, long_prompt, CONVERSATIONAL, IMPLICIT_CHAT]
    fitted = [fit_pair(*ids, SEQ_LEN, SEQ_LEN // 2) for ids in trl_tokenized(tokenizer, kept)]
    expected = [pair for pair, _ in fitted]
    records = stats["records"]
    assert (records["read"], records["kept"], records["skipped"]) == (11, 5, 6)
    assert records["truncated"] == sum(cut for _, cut in fitted) and fitted[2][1]  # the long prompt's, at least
    assert records["skipped_by_reason"] == {reason: 1 for _, reason in BAD}
    loader = ShardLoader(out, micro_batch=len(kept), shuffle=False)
    batch = loader.next_batch()
    assert set(batch) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels",
                          "stream_position"}
    pad = manifest["tokenizer"]["pad_id"]
    for row, (prompt, chosen, rejected) in enumerate(expected):
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = batch[f"{side}_input_ids"][row].tolist(), batch[f"{side}_labels"][row].tolist()
            used = len(prompt) + len(completion)
            assert ids == prompt + completion + [pad] * (SEQ_LEN - used)
            assert labels == [IGNORE_INDEX] * len(prompt) + completion + [IGNORE_INDEX] * (SEQ_LEN - used)
    assert len(expected[2][0]) == SEQ_LEN // 2  # the long prompt kept its last half of the block
    assert stats["splits"]["train"]["label_tokens"] == sum(len(c) + len(r) for _, c, r in expected)


def test_a_prompt_longer_than_the_block_leaves_no_completion_and_is_counted(tiny_model_dir, tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", [STANDARD, {"prompt": "Cluj " * 80, "chosen": " A.", "rejected": " B."}])
    out = tmp_path / "pairs"
    assert prepare.main(["--tokenizer", str(tiny_model_dir), "--seq-len", "16", "--max-prompt-len", "16",
                         "--out", str(out), "--quiet", "--format", "preference", "--input", pairs]) == 0
    records = json.loads((out / "stats.json").read_text())["records"]
    assert records["skipped_by_reason"] == {"no_completion_left": 1} and records["kept"] == 1
    assert np.load(out / "train" / "chosen_input_ids.npy").shape[1] == 16


def test_adapters_side_by_side_take_one_kind_of_data_and_a_reference_needs_pairs(tiny_model_dir, data, tmp_path,
                                                                                 capsys):
    from trainer_helpers import write_run_config

    from finetuning_pipeline import evaluate, main

    side_by_side = {"data": "", "init": "fresh",
                    "adapters": {"a": {"data": str(data["pairs"])}, "b": {"data": str(data[2])}}}
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, data, tmp_path / "o", phase2=side_by_side)
    assert main.main(["--config", str(config)]) == 2
    assert ("phase2.adapters: side by side, every adapter's data is of one kind; phase2.adapters.a.data hold "
            "preference pairs, the others next-token data" in capsys.readouterr().err)
    both_pairs = {**side_by_side, "adapters": {"a": {"data": str(data["pairs"])}, "b": {"data": str(data["pairs"])}}}
    config = write_run_config(tmp_path / "r2.yaml", tiny_model_dir, data, tmp_path / "o2", phase2=both_pairs)
    assert main.main(["--config", str(config), "phase2.preference.precompute_reference=true"]) == 2
    assert "phase2.preference.precompute_reference: not for adapters side by side yet" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_status:  # argparse's usage error
        evaluate.main(["--model", str(tiny_model_dir), "--data", str(data[2]), "--reference", "base"])
    assert exit_status.value.code == 2
    assert f"--data {data[2]} holds no preference pairs (its phase is 2)" in capsys.readouterr().err


def test_a_hugging_face_dataset_of_pairs_with_its_own_column_names(tokenizer, tiny_model_dir, tmp_path):
    import datasets

    rows = [{"question": STANDARD["prompt"], "good": STANDARD["chosen"], "bad": STANDARD["rejected"]}] * 3
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "pairs"
    assert prepare.main(["--tokenizer", str(tiny_model_dir), "--seq-len", str(SEQ_LEN), "--out", str(out), "--quiet",
                         "--eval-fraction", "0", "--format", "hf", "--input", str(tmp_path / "ds"),
                         "--column", "prompt=question", "--column", "chosen=good", "--column", "rejected=bad"]) == 0
    assert json.loads((out / "stats.json").read_text())["records"]["kept"] == 3
    prompt, chosen, _ = trl_tokenized(tokenizer, [STANDARD])[0]
    row = np.load(out / "train" / "chosen_input_ids.npy")[0].tolist()
    assert row[:len(prompt) + len(chosen)] == prompt + chosen
