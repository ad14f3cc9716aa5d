"""A byte-level tokenizer built in code, for random-weight models.

Random-initialised models (``tiny_llama``, ``tiny_qwen2``, ``llama31_8b_shape``) need a tokenizer for
the same task code that real models run, but no hub or asset: every UTF-8 byte is one token, plus
ChatML control tokens. Prompt lengths in tokens are then lengths in bytes.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: 256 byte tokens, then the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1 << 30,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok
