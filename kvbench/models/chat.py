"""Turning a task's prompt into token ids under a model's chat protocol."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvbench.errors import ConfigError


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat template and system prompt, applied (or not) per prompt.

    Benchmarks decide per task whether the template applies (LongBench skips it for six few-shot and
    code datasets); the model decides what the template is.
    """

    tokenizer: PreTrainedTokenizerBase
    system_prompt: str | None = None
    template: str | None = None  # overrides the tokenizer's template when set

    @property
    def available(self) -> bool:
        return bool(self.template or self.tokenizer.chat_template)

    def render(self, user: str, *, assistant_prefix: str = "") -> str:
        """The text of a one-turn conversation, ending where the assistant starts writing."""
        if not self.available:
            raise ConfigError(
                "this model has no chat template",
                "set model.chat_template to a Jinja template, or run the task with its template switched off",
            )
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": user})
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=self.template
        )
        assert isinstance(text, str)  # (tokenize=False)
        return text + assistant_prefix

    def encode(self, user: str, *, use_template: bool = True, assistant_prefix: str = "") -> list[int]:
        """Token ids of a prompt; raw prompts get the tokenizer's special tokens (e.g. BOS)."""
        if use_template:
            text = self.render(user, assistant_prefix=assistant_prefix)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(user + assistant_prefix, add_special_tokens=True).input_ids
