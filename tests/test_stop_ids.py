"""Stop ids: every end-of-turn / end-of-text token of a packaged model's chat template stops generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbench.errors import ConfigError
from kvbench.models.loading import _stop_ids
from tests.conftest import model_config


class _Tokenizer:
    """A vocabulary whose unknown token is also a real stop token (SmolLM2's converted tokenizer)."""

    unk_token, unk_token_id, eos_token_id = "<|endoftext|>", 0, 2

    def get_vocab(self):
        return {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3}

    def convert_tokens_to_ids(self, token):
        return self.get_vocab().get(token, self.unk_token_id)


def test_a_stop_token_that_is_also_the_unknown_token_is_kept():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=2))
    cfg = {"name": "m", "stop_tokens": ["<|im_end|>", "<|endoftext|>"]}
    assert _stop_ids(cfg, model, _Tokenizer()) == (2, 0)
    with pytest.raises(ConfigError, match="not in its tokenizer's vocabulary"):
        _stop_ids({"name": "m", "stop_tokens": ["</s>"]}, model, _Tokenizer())


def turn_end_ids(loaded) -> list[int]:
    """The token ids the chat template writes right after an assistant message: what the model emits
    when it ends its turn."""
    tokenizer = loaded.tokenizer
    reply = "Fine, thanks."
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": reply}], tokenize=False
    )
    after = text[text.rindex(reply) + len(reply) :]
    special = [t for t in tokenizer.get_vocab() if t.startswith("<|") and t.endswith("|>") and after.startswith(t)]
    assert special, f"no special token after the assistant message in {after!r}"
    return [tokenizer.get_vocab()[t] for t in special]


def _converted(name: str) -> bool:
    from kvbench.assets import kvbench_home

    return (kvbench_home() / "models" / name).is_dir()


@pytest.mark.integration
@pytest.mark.parametrize(
    "name",
    [
        "smollm2_135m",
        "qwen25_05b",
        # 1.1 GB of wheels and a conversion that peaks near 15 GB of RAM: checked where it is converted
        pytest.param(
            "qwen25_15b",
            marks=pytest.mark.skipif(not _converted("qwen25_15b"), reason="qwen25_15b not converted (kvbench fetch)"),
        ),
    ],
)
def test_packaged_models_stop_at_their_templates_turn_end_and_at_end_of_text(name):
    from kvbench.models.loading import load_model

    loaded = load_model(model_config(name))
    stops = set(loaded.spec.stop_ids)
    assert set(turn_end_ids(loaded)) <= stops  # <|im_end|>
    assert loaded.tokenizer.get_vocab()["<|endoftext|>"] in stops  # the end of a document
    assert loaded.tokenizer.eos_token_id in stops
