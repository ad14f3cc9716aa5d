"""InfiniteBench protocol constants: the 12 tasks, prompt sets and generation lengths.

Prompt sets (``OpenBMB/InfiniteBench`` ``src/prompt.py``): ``open`` — the completion-style templates
used for open models (YaRN-Mistral, Yi, ChatGLM3), no chat template; ``chat`` — the instruction-style
templates of the GPT-4 runs, wrapped in the model's chat template (lm-eval uses these); ``infllm`` —
InfLLM's own ``benchmark/config/dataset2prompt.json`` (PQCache's InfiniteBench pipeline is its InfLLM
fork): the ``chat`` set except for kv_retrieval (the key named in the instruction, ``{key}``),
longbook_qa_eng and code_debug.
``math_find``'s ``{prefix}`` is "What is the <largest|smallest|median> number in the following list?",
taken from the sample's question with ``The \\w+ number`` (InfLLM: ``The .+ of``, see ``infinitebench.py``).
"""

from __future__ import annotations

from typing import Any

TASKS = (
    "passkey",
    "number_string",
    "kv_retrieval",
    "longbook_sum_eng",
    "longbook_choice_eng",
    "longbook_qa_eng",
    "longbook_qa_chn",
    "longdialogue_qa_eng",
    "math_find",
    "math_calc",
    "code_run",
    "code_debug",
)
SYNTHETIC = ("passkey", "number_string", "kv_retrieval", "math_find")
#: the nine tasks PQCache's Table 4 reports
PQCACHE = (
    "longbook_sum_eng",
    "longbook_qa_eng",
    "longbook_choice_eng",
    "longdialogue_qa_eng",
    "longbook_qa_chn",
    "math_find",
    "passkey",
    "number_string",
    "kv_retrieval",
)

MAX_NEW_TOKENS = {
    "official": {
        "passkey": 6,
        "number_string": 12,
        "kv_retrieval": 50,
        "longbook_sum_eng": 1200,
        "longbook_choice_eng": 40,
        "longbook_qa_eng": 40,
        "longbook_qa_chn": 40,
        "longdialogue_qa_eng": 40,
        "math_find": 3,
        "math_calc": 30000,
        "code_run": 5,
        "code_debug": 5,
    },
    # InfLLM's (and PQCache's, whose InfiniteBench pipeline is InfLLM's) generation lengths
    "infllm": {
        "passkey": 32,
        "number_string": 32,
        "kv_retrieval": 100,
        "longbook_sum_eng": 1536,
        "longbook_choice_eng": 32,
        "longbook_qa_eng": 32,
        "longbook_qa_chn": 32,
        "longdialogue_qa_eng": 32,
        "math_find": 32,
        "math_calc": 64000,
        "code_run": 32,
        "code_debug": 32,
    },
}

_MC = "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"

OPEN_TEMPLATES = {
    "passkey": (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
        "quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe pass key is"
    ),
    "number_string": (
        "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about "
        "the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is"
    ),
    "kv_retrieval": (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"
    ),
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": (
        "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n"
        + _MC
        + "\n\nThe letter of the correct answer is"
    ),
    "longbook_qa_eng": (
        "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
        "Question: {question}\nAnswer:"
    ),
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": (
        "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]"
        "\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:"
    ),
    "code_run": (
        "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the exact "
        "value of {func_call}. The value of {func_call} is"
    ),
    "code_debug": (
        "Following is a Python code where exactly one of the functions/methods has a deliberate error that "
        "makes it crash.\n\n{context}\n\nOptions:\n" + _MC + "\n\nThe correct option is:"
    ),
    "longdialogue_qa_eng": (
        "Below is a dialogue script where one random occurrence of a character name is replaced with "
        '"$$MASK$$", and you should try to guess who that character is.\n\n{context}\n\nThe name '
        "that has been replaced with $$MASK$$ is likely"
    ),
}

CHAT_TEMPLATES = {
    "passkey": (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
        "quiz you about the important information there.\n\n{context}\n\n{input}"
    ),
    "number_string": (
        "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about "
        "the important information there.\n\n{context}\n\n{input}"
    ),
    "kv_retrieval": (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"
    ),
    "longbook_qa_eng": (
        "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\nBe very concise."
    ),
    "longbook_choice_eng": (
        "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\nOnly one of "
        "the following options is correct, tell me the answer using one single letter (A, B, C, or "
        "D). Don't say anything else.\n" + _MC
    ),
    "longbook_sum_eng": "Summarize the following book.\n\n{context}",
    "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Compute the intermediate values in the following long expression.\n\n{context}",
    "code_run": (
        "Following is a set of Python functions. There is a function called named {func}.\n\n{context}\n\n"
        "Please give me the exact number of the return value of {func_call}. Be concise. Your response must "
        "end with the final returned value."
    ),
    "code_debug": (
        "There is ONLY ONE function in the large project that is deliberately made to include an obvious "
        "error. Please find the function that contains the most obvious errors. I will give you four "
        "options to narrow your scope. You can inspect through the options and think. Eventually, tell me "
        "the answer using one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate "
        "error?\n" + _MC + "\n\nYou should first find the functions in the options. Repeat their content, "
        "inspect through code, and at last give me your answer for the function that has the deliberate "
        "and obvious error in A, B, C, or D."
    ),
    "longdialogue_qa_eng": (
        "Below is a dialogue script where one random occurrence of a character name is replaced with "
        '"$$MASK$$", and you should try to guess who that character is.\n\nThe dialogue:\n\n---\n\n'
        '{context}\n\n---\n\nEnd of dialogue.\n\nWhich character is most likely "$$MASK$$"? Just say '
        "the name used by the scriptwriter (before the colon marks) of one single character and "
        "nothing else."
    ),
}

#: InfLLM's prompts (``benchmark/config/dataset2prompt.json``): the chat set with three differences
INFLLM_TEMPLATES = {
    **CHAT_TEMPLATES,
    "kv_retrieval": (
        "Extract the value corresponding to the specified key {key} in the JSON object below.\n\n{context}\n\n{input}"
    ),
    "longbook_qa_eng": (
        "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\nPlease "
        "answer as short as possible. The answer is:"
    ),
    "code_debug": (
        "There is ONLY ONE function in the large project that is deliberately made to include an obvious "
        "error. Please find the function that contains the most obvious errors. I will give you four options "
        "to narrow your scope. You can inspect the options and think. Eventually, tell me the answer using "
        "one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate error?\nA. "
        "{OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nGive me your answer for the function that "
        "has the deliberate and obvious error in A, B, C, or D. Your answer MUST be chosen from one of the "
        "four options without any explanation. If you cannot determine answers accurately, you also MUST "
        "provide the answer you think is most likely. Absolutely do not say you do not know or you need "
        "more information."
    ),
}

#: InfLLM's per-model settings (PQCache's InfLLM fork: ``config/*-inf-llm.yaml`` and ``benchmark/pred.py``):
#: ``truncation`` ``suffix`` (the first :data:`INFLLM_INIT_TOKENS` tokens plus the tail, after the chat
#: template) or ``None`` (the Llama-3 config: none at all); ``max_len`` = prompt plus generation (``None``:
#: the model's context); ``special_tokens``: whether the templated text is tokenised with the tokenizer's
#: special tokens (not for ``mistral-inst``, whose template writes ``<s>`` itself)
INFLLM_CONV: dict[str, dict[str, Any]] = {
    "llama-3-inst": {"truncation": None, "max_len": None, "special_tokens": True},
    "mistral-inst": {"truncation": "suffix", "max_len": 32000, "special_tokens": False},
    "chat": {"truncation": "suffix", "max_len": None, "special_tokens": True},  # InfLLM's qwen / minicpm rule
}
INFLLM_INIT_TOKENS = 128


def infllm_conv(model_name: str) -> str:
    """InfLLM's ``conv_type`` for a kvbench model name (its PQCache configs: llama-3-inst, mistral-inst); any
    other chat model gets ``chat`` (kvbench: suffix truncation to the model's context)."""
    name = model_name.lower()
    if "llama" in name and "3" in name:
        return "llama-3-inst"
    if "mistral" in name:
        return "mistral-inst"
    return "chat"


#: named protocols: prompt set, chat template, generation lengths, truncation length (tokens)
PROTOCOLS: dict[str, dict[str, Any]] = {
    "open": {"templates": "open", "chat": False, "max_new_tokens": "official", "max_length": 128 * 1024},
    "chat": {"templates": "chat", "chat": True, "max_new_tokens": "official", "max_length": 128 * 1024},
    "infllm": {"templates": "infllm", "chat": True, "max_new_tokens": "infllm", "max_length": None},
}
