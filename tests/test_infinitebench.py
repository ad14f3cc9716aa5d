import json

import pytest

from kvbench.errors import ConfigError
from kvbench.tasks import create_task
from kvbench.tasks.infinitebench import Generator, labels_for, truncate_middle

from .conftest import SHARED_DATA

ARCHIVE = SHARED_DATA / "infinitebench" / "passkey_lengths_archive"


@pytest.mark.skipif(not ARCHIVE.exists(), reason="needs ../shared/data/infinitebench")
@pytest.mark.parametrize("length", [8192, 16384])
def test_generator_reproduces_the_released_passkey_files(length):
    units = round(length / (32768 / 1305))
    for line in (ARCHIVE / f"passkey_{length}.first5.jsonl").read_text().splitlines():
        real = json.loads(line)
        ours = Generator(0).retrieval("passkey", units, 0.0, key=real["answer"])
        assert ours["context"] == real["context"] and ours["input"] == real["input"]
        assert ours["len"] == int(real["len"])


def test_generated_prompts_hit_the_token_length(tiny_llama):
    task = create_task(
        {
            "name": "infinitebench",
            "subsets": ["passkey", "number_string", "kv_retrieval", "math_find"],
            "lengths": [1200],
            "depths": [0.0, 1.0],
        }
    )
    samples = list(task.samples(tiny_llama))
    assert [s.id for s in samples] == task.sample_ids()
    for sample in samples:
        assert 1100 <= len(sample.input_ids) <= 1200, (sample.id, len(sample.input_ids))
    text = tiny_llama.tokenizer.decode(samples[0].input_ids)
    key = samples[0].reference[0]
    assert len(key) == 5 and text.index(f"The pass key is {key}") < 300 and text.endswith("The pass key is")
    digits = samples[2].reference[0]
    assert len(digits) == 10 and samples[3].meta["depth"] == 1.0
    kv = tiny_llama.tokenizer.decode(samples[5].input_ids)
    assert samples[5].reference[0] in kv and kv.rstrip().endswith("is:")
    assert samples[6].max_new_tokens == 3


def test_generation_is_deterministic(tiny_llama):
    cfg = {"name": "infinitebench", "subsets": ["passkey"], "lengths": [600], "depths": [0.5]}
    a = next(iter(create_task(cfg).samples(tiny_llama)))
    b = next(iter(create_task(cfg).samples(tiny_llama)))
    assert a.input_ids == b.input_ids and a.reference == b.reference


def test_protocols_templates_and_question_first(tiny_llama):
    chat = create_task({"name": "infinitebench", "protocol": "infllm", "lengths": [600], "depths": [0.5]})
    sample = next(iter(chat.samples(tiny_llama)))
    assert tiny_llama.tokenizer.decode(sample.input_ids).startswith("<|im_start|>user") and sample.max_new_tokens == 32
    start = create_task({"name": "infinitebench", "question_position": "start", "lengths": [600], "depths": [0.5]})
    text = tiny_llama.tokenizer.decode(next(iter(start.samples(tiny_llama))).input_ids)
    assert text.startswith("What is the pass key?\n\nThere is an important info") and text.endswith("The pass key is")


def test_truncation_and_labels():
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]  # -5 // 2 == -3, as the official slicing
    row = {"answer": ["Paris"], "options": ["Rome", "Paris", "Oslo", "Lima"]}
    assert labels_for("longbook_choice_eng", row) == ["Paris", "B"]
    assert labels_for("passkey", {"answer": "12345"}) == ["12345"]


def test_prompts_longer_than_the_model_are_cut_to_its_context(tiny_llama, tmp_path):
    row = {"id": 0, "context": "The grass is green. " * 1000, "input": "", "answer": "12345"}
    (tmp_path / "passkey.jsonl").write_text(json.dumps(row) + "\n")
    task = create_task({"name": "infinitebench", "data_dir": str(tmp_path)})
    sample = next(iter(task.samples(tiny_llama)))
    assert len(sample.input_ids) == tiny_llama.spec.max_length - sample.max_new_tokens
    assert sample.meta["truncated_from"] > 20000
    explicit = create_task({"name": "infinitebench", "data_dir": str(tmp_path), "max_length": 1000})
    assert len(next(iter(explicit.samples(tiny_llama))).input_ids) == 1000


def test_real_tasks_need_data():
    with pytest.raises(ConfigError, match="cannot be generated"):
        create_task({"name": "infinitebench", "subsets": ["longbook_qa_eng"]})
    with pytest.raises(ConfigError, match="unknown InfiniteBench task"):
        create_task({"name": "infinitebench", "subsets": ["nope"]})


@pytest.mark.skipif(not ARCHIVE.exists(), reason="needs ../shared/data/infinitebench")
def test_real_passkey_file(tiny_llama):
    task = create_task(
        {"name": "infinitebench", "data_dir": str(ARCHIVE), "file": "passkey_8192.first5.jsonl", "limit": 2}
    )
    samples = list(task.samples(tiny_llama))
    assert len(samples) == 2 and samples[0].reference == ["69682"] and samples[0].subset == "passkey"
    assert task.score(samples[0], "69682.") == 100.0 and task.score(samples[0], "12345") == 0.0


def test_infllm_protocol_is_infllms_pred_script(tiny_llama, tmp_path):
    """InfLLM's prompts, the user-only chat template, and its suffix truncation after the template:
    the first 128 tokens plus the tail; none for Llama-3 names, 32000 for Mistral."""
    from types import SimpleNamespace

    from kvbench.tasks.infinitebench import truncate_suffix
    from kvbench.tasks.infinitebench_protocol import infllm_conv

    assert [infllm_conv(n) for n in ("llama31_8b_instruct", "mistral7b_instruct_v02", "qwen25_05b")] == [
        "llama-3-inst",
        "mistral-inst",
        "chat",
    ]
    row = {
        "id": 0,
        "context": "HEAD " + "The grass is green. " * 400 + " TAIL",
        "input": "What is the pass key?",
        "answer": "12345",
    }
    (tmp_path / "passkey.jsonl").write_text(json.dumps(row) + "\n")
    tok = tiny_llama.tokenizer

    def sample(name, **cfg):
        model = SimpleNamespace(spec=SimpleNamespace(name=name, max_length=16384), tokenizer=tok, chat=tiny_llama.chat)
        task = create_task({"name": "infinitebench", "protocol": "infllm", "data_dir": str(tmp_path), **cfg})
        return next(iter(task.samples(model))), task

    full, _ = sample("llama31_8b_instruct")  # Llama-3: no truncation (the prompt is ~8.5k tokens)
    assert "truncated_from" not in full.meta and tok.decode(full.input_ids).startswith("<|im_start|>user\n")
    cut, task = sample("llama31_8b_instruct", max_length=1000)  # an explicit max_len: 1000 - 32 generated
    assert len(cut.input_ids) == 1000 - 32 and cut.meta["truncated_from"] == len(full.input_ids)
    assert cut.input_ids[:128] == full.input_ids[:128] and cut.input_ids[128:] == full.input_ids[-(1000 - 32 - 128) :]
    assert tok.decode(cut.input_ids).rstrip().endswith("<|im_start|>assistant")  # the template's tail survives
    assert "suffix" in task.protocol()["truncation"]
    assert truncate_suffix(tok, list(range(10)), 20, True) == list(range(10))
    other, _ = sample("qwen25_05b")  # no InfLLM config: the model's context (16384) is enough here
    assert other.input_ids == full.input_ids


def test_infllm_prompts(tiny_llama):
    task = create_task({"name": "infinitebench", "protocol": "infllm", "subsets": ["kv_retrieval"]})
    row = {"context": "JSON data:\n{}", "input": 'Key: "ab-12"\nThe value associated with the specified key is: '}
    assert task.format_prompt("kv_retrieval", row).startswith(
        'Extract the value corresponding to the specified key "ab-12" in the JSON object below.'
    )
    row = {
        "context": "[1, 2]",
        "input": "You should answer with only one number, no other words. The largest number of the list is: ",
    }
    assert task.format_prompt("math_find", row).startswith("What is the largest number in the following list?")
    # InfLLM's "The .+ of" also takes words other than "number", where the other protocols' "The \w+ number" fails
    row["input"] = "The largest element of the list is: "
    assert task.format_prompt("math_find", row).startswith("What is the largest element in the following list?")
    with pytest.raises(ConfigError, match="math_find"):
        create_task({"name": "infinitebench", "protocol": "chat", "subsets": ["math_find"]}).format_prompt(
            "math_find", row
        )
