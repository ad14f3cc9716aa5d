"""LongBench v1 protocol constants: prompts, generation lengths, metrics, and per-paper length limits.

Prompts and generation lengths are LongBench's ``config/dataset2prompt.json`` and
``config/dataset2maxlen.json`` (THUDM/LongBench, MIT; the official narrativeqa typo "asconcisely" is
kept); the tests compare them with the official files when those are at hand. ``task.config_dir``
can point at a folder with the official JSON files instead.
"""

from __future__ import annotations

from typing import NamedTuple


class Dataset(NamedTuple):
    name: str
    category: str
    language: str  # en | zh | code
    metric: str  # a function of kvbench.tasks.metrics
    max_new_tokens: int
    in_e: bool  # has a LongBench-E variant (<name>_e)
    prompt: str


DATASETS: dict[str, Dataset] = {
    "narrativeqa": Dataset(
        "narrativeqa",
        "single_doc_qa",
        "en",
        "qa_f1_score",
        128,
        False,
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    ),
    "qasper": Dataset(
        "qasper",
        "single_doc_qa",
        "en",
        "qa_f1_score",
        128,
        True,
        'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    ),
    "multifieldqa_en": Dataset(
        "multifieldqa_en",
        "single_doc_qa",
        "en",
        "qa_f1_score",
        64,
        True,
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    ),
    "multifieldqa_zh": Dataset(
        "multifieldqa_zh",
        "single_doc_qa",
        "zh",
        "qa_f1_zh_score",
        64,
        False,
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    ),
    "hotpotqa": Dataset(
        "hotpotqa",
        "multi_doc_qa",
        "en",
        "qa_f1_score",
        32,
        True,
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    ),
    "2wikimqa": Dataset(
        "2wikimqa",
        "multi_doc_qa",
        "en",
        "qa_f1_score",
        32,
        True,
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    ),
    "musique": Dataset(
        "musique",
        "multi_doc_qa",
        "en",
        "qa_f1_score",
        32,
        False,
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    ),
    "dureader": Dataset(
        "dureader",
        "multi_doc_qa",
        "zh",
        "rouge_zh_score",
        128,
        False,
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    ),
    "gov_report": Dataset(
        "gov_report",
        "summarization",
        "en",
        "rouge_score",
        512,
        True,
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    ),
    "qmsum": Dataset(
        "qmsum",
        "summarization",
        "en",
        "rouge_score",
        512,
        False,
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    ),
    "multi_news": Dataset(
        "multi_news",
        "summarization",
        "en",
        "rouge_score",
        512,
        True,
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    ),
    "vcsum": Dataset(
        "vcsum",
        "summarization",
        "zh",
        "rouge_zh_score",
        512,
        False,
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    ),
    "trec": Dataset(
        "trec",
        "few_shot",
        "en",
        "classification_score",
        64,
        True,
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    ),
    "triviaqa": Dataset(
        "triviaqa",
        "few_shot",
        "en",
        "qa_f1_score",
        32,
        True,
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    ),
    "samsum": Dataset(
        "samsum",
        "few_shot",
        "en",
        "rouge_score",
        128,
        True,
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    ),
    "lsht": Dataset(
        "lsht",
        "few_shot",
        "zh",
        "classification_score",
        64,
        False,
        "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    ),
    "passage_count": Dataset(
        "passage_count",
        "synthetic",
        "en",
        "count_score",
        32,
        True,
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    ),
    "passage_retrieval_en": Dataset(
        "passage_retrieval_en",
        "synthetic",
        "en",
        "retrieval_score",
        32,
        True,
        'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    ),
    "passage_retrieval_zh": Dataset(
        "passage_retrieval_zh",
        "synthetic",
        "zh",
        "retrieval_zh_score",
        32,
        False,
        '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    ),
    "lcc": Dataset(
        "lcc",
        "code",
        "code",
        "code_sim_score",
        64,
        True,
        "Please complete the code given below. \n{context}Next line of code:\n",
    ),
    "repobench-p": Dataset(
        "repobench-p",
        "code",
        "code",
        "code_sim_score",
        64,
        True,
        "Please complete the code given below. \n{context}{input}Next line of code:\n",
    ),
}

#: no chat template for these (few-shot and code completion), as the official pred.py
NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
#: predictions cut to their first line before scoring
FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")
#: the QA datasets whose question can move before the context (PQCache Table 3)
QA = ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique", "dureader")

GROUPS: dict[str, tuple[str, ...]] = {
    "all": tuple(DATASETS),
    "en": tuple(d for d, v in DATASETS.items() if v.language != "zh"),
    "e": tuple(d for d, v in DATASETS.items() if v.in_e),
    # PQCache Table 2: 14 English tasks (no code)
    "pqcache": (
        "narrativeqa",
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "musique",
        "gov_report",
        "qmsum",
        "multi_news",
        "trec",
        "triviaqa",
        "samsum",
        "passage_count",
        "passage_retrieval_en",
    ),
    # PQCache Table 3: question-first QA
    "pqcache_qa": ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"),
    # ClusterKV Table I / Fig. 9
    "clusterkv": (
        "narrativeqa",
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "musique",
        "gov_report",
        "triviaqa",
    ),
}

#: prompt-length limits (tokens, before the chat template) used by each protocol, by model name;
#: "official" is LongBench's model2maxlen for its models, the others are what each paper's code used.
LENGTH_LIMITS: dict[str, dict[str, int]] = {
    "official": {
        "llama2-7b-chat-4k": 3500,
        "longchat-v1.5-7b-32k": 31500,
        "xgen-7b-8k": 7500,
        "internlm-7b-8k": 7500,
        "chatglm2-6b": 31500,
        "chatglm2-6b-32k": 31500,
        "chatglm3-6b-32k": 31500,
        "vicuna-v1.5-7b-16k": 15500,
    },
    "pqcache": {"llama31_8b_instruct": 130000, "mistral7b_instruct_v02": 32000},
    "quest": {"llama31_8b_instruct": 1047500, "glm4_9b_chat": 31500},
    "kvcache_factory": {"llama31_8b_instruct": 7500, "mistral7b_instruct_v02": 31500},
}

#: PQCache's ``vq_pred.py`` ``build_chat``: the system message it gives Llama-3 models
PQCACHE_SYSTEM_PROMPT = "You are a helpful assistant."


def pqcache_chat_style(model_name: str) -> str | None:
    """How PQCache's ``vq_pred.py`` wraps a chat-style LongBench prompt, keyed on the model's name as
    its ``build_chat`` is: ``system`` — the tokenizer's chat template with the system message
    :data:`PQCACHE_SYSTEM_PROMPT` (names with "llama" and "3": Llama-3 / 3.1); ``inst`` — the raw string
    ``[INST]{prompt}[/INST]``, no spaces (Mistral, and Llama-2 names); ``None`` — a model the script has
    no rule for (kvbench then uses the model's own template, as the official protocol does)."""
    name = model_name.lower()
    if "llama" in name:
        return "system" if "3" in name else "inst"
    if "mistral" in name:
        return "inst"
    return None
