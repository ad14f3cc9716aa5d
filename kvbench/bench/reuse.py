"""Benchmark of the reuse family: time to first token of CacheBlend and full KV reuse vs full prefill.

CacheBlend's headline (paper Fig. 12: TTFT 2.2–3.3× below full recompute on a GPU) is a ratio of
prefill times on the same prompts. ``reuse_ttft`` measures it side by side in one process: for each
prompt, ``full`` (dense prefill), ``cacheblend`` at ``recompute_ratio`` 0.15 and ``full_reuse``, with
chunk caches served from the RAM tier and from the disk tier (cold reads: the file is dropped from the
page cache first). Chunk precomputation happens before the clock (as a store would hold the chunks
from earlier requests) and is not part of TTFT; loading them from the tier is.

Prompts: CacheBlend's musique inputs (10 passages per question, the rag task's prompt layout) when
``KVBENCH_RAG_DATA`` names the folder holding ``musique_s.json`` (e.g. ``../shared/data/cacheblend``);
otherwise musique-shaped synthetic prompts cut from the packaged essays (a prefix, 10 chunks of
``CHUNK`` tokens, a question), so the benchmark runs offline from a clean clone.

Long prompts (``--lengths 6144,16384,32768``): one synthetic prompt of exactly each length — the
same layout, 10 chunks sharing what the prefix and the question leave (the essays repeat when a
length needs more text than they hold) — e.g. on the Llama-3.1-8B shape on a GPU, where CacheBlend's
claim (TTFT 2.2–3.3× below full at r = 0.15) is about prompts of thousands of tokens:
``kvbench bench reuse_ttft --model llama31_8b_shape --lengths 6144,16384,32768``. ``--methods``
keeps some configurations (``full`` always runs: the ratios' denominator), by method name, or
``name:tier`` for one tier (``--methods cacheblend:ram,full_reuse:ram`` leaves out the disk runs).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from kvbench.bench import BenchOptions, BenchResult, benchmark
from kvbench.errors import ConfigError

CHUNK = 560
CONFIGS: tuple[tuple[str, dict[str, Any], str | None], ...] = (
    ("full", {}, None),
    ("cacheblend@0.15", {"name": "cacheblend", "recompute_ratio": 0.15}, "ram"),
    # the check layer as kvbench ran it before 2026-11-29: every row through attention and MLP
    ("cacheblend@0.15 check_rows=all", {"name": "cacheblend", "recompute_ratio": 0.15, "check_rows": "all"}, "ram"),
    ("full_reuse", {"name": "full_reuse"}, "ram"),
    ("cacheblend@0.15", {"name": "cacheblend", "recompute_ratio": 0.15}, "disk"),
    ("full_reuse", {"name": "full_reuse"}, "disk"),
    ("prefix_cache", {"name": "prefix_cache"}, "ram"),  # hits the prefix and the first chunk only
)


def _prompts(loaded: Any, count: int, chunk: int = CHUNK, lengths: tuple[int, ...] = ()) -> tuple[list[Any], str]:
    """``count`` chunked prompts (tuples of Segments) and where they come from (synthetic chunks of
    ``chunk`` tokens); with ``lengths``, one synthetic prompt of each length instead."""
    from kvbench.requests import Segment

    folder = os.environ.get("KVBENCH_RAG_DATA")
    if folder and not lengths:
        from kvbench.tasks import create_task

        task = create_task({"name": "rag", "dataset": "musique", "data_dir": folder, "limit": count})
        prompts = []
        for sample in task.samples(loaded):
            assert sample.segments is not None  # (rag samples are segmented)
            prompts.append(tuple(sample.segments))
        return prompts, f"musique (first {len(prompts)}, {folder})"
    from kvbench.assets import fetch_asset

    text = "".join(
        p.read_text(encoding="utf-8", errors="replace") for p in sorted(fetch_asset("paul_graham_essays").glob("*.txt"))
    )
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
    prefix = loaded.chat.encode("Answer the question from the passages.\n", use_template=False)
    question = loaded.tokenizer(
        "\n\nQuestion: what is the author's advice?\nAnswer:", add_special_tokens=False
    ).input_ids
    prompts = []
    if lengths:
        start = 0
        for length in lengths:
            body = length - len(prefix) - len(question)
            if body < 10:
                raise ConfigError(
                    f"--lengths {length} leaves no room for 10 chunks", "use lengths of 64 tokens or more"
                )
            sizes = [body // 10] * 9 + [body - 9 * (body // 10)]  # the last chunk takes the remainder
            chunks = []
            for size in sizes:
                chunks.append(Segment(tuple(ids[(start + i) % len(ids)] for i in range(size)), "chunk"))
                start += size
            prompts.append((Segment(tuple(prefix), "prefix"), *chunks, Segment(tuple(question), "query")))
        return prompts, "synthetic: essays cut into 10 chunks per prompt, one prompt per --lengths value"
    for p in range(count):
        start = p * 10 * chunk
        chunks = [Segment(tuple(ids[start + i * chunk : start + (i + 1) * chunk]), "chunk") for i in range(10)]
        prompts.append((Segment(tuple(prefix), "prefix"), *chunks, Segment(tuple(question), "query")))
    return prompts, f"synthetic: essays cut into 10 chunks of {chunk} tokens"


def _configs(methods: tuple[str, ...] | None) -> list[tuple[str, dict[str, Any], str | None]]:
    """:data:`CONFIGS` kept by ``--methods`` (names, or ``name:tier``); ``full`` always."""
    if not methods:
        return list(CONFIGS)
    known = {cfg.get("name", label) for label, cfg, _ in CONFIGS}
    wanted = set()
    for entry in methods:
        name, _, tier = entry.partition(":")
        if name not in known or (tier and tier not in ("ram", "disk")):
            raise ConfigError(
                f"--methods {entry!r} is not one of reuse_ttft's configurations",
                f"use names from {', '.join(sorted(known))}, optionally with :ram or :disk",
            )
        wanted.add((name, tier or None))
    return [
        (label, cfg, tier)
        for label, cfg, tier in CONFIGS
        if tier is None or (cfg["name"], None) in wanted or (cfg["name"], tier) in wanted
    ]


def _store_gb(loaded: Any, tokens: int) -> float:
    """GB of chunk caches for ``tokens`` prompt tokens of this model (K and V, every layer)."""
    import torch

    spec = loaded.spec
    element = torch.empty(0, dtype=next(loaded.model.parameters()).dtype).element_size()
    return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * element * tokens / 2**30


@benchmark("reuse_ttft")
def reuse_ttft(options: BenchOptions) -> BenchResult:
    """TTFT of cacheblend@0.15 and full_reuse vs full on 10-chunk prompts, chunks from RAM and disk, and
    of prefix_cache (chunks from RAM); ``--lengths``: one prompt of each length."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import generate
    from kvbench.kv.chunks import ChunkStore, StoreConfig
    from kvbench.methods import create_method, method_node
    from kvbench.methods.reuse import ReuseMethod
    from kvbench.models.loading import load_model
    from kvbench.requests import join_segments

    name, lengths, _ = options.e2e("smollm2_135m", ())
    from kvbench.compose import compose

    configs = _configs(options.methods)
    loaded = load_model(compose([f"model={name}"])["model"])
    count = 1 if options.quick else 3
    # --quick: a smoke test
    prompts, source = _prompts(loaded, count, 64 if options.quick else CHUNK, tuple(lengths))
    repeats = max(1, min(options.repeats, 3))
    rows = []
    longest = max(len(join_segments(segments)) for segments in prompts)
    with tempfile.TemporaryDirectory() as scratch:
        stores = {  # room for two of the longest prompts' chunks
            "ram": ChunkStore(StoreConfig(tier="ram", ram_gb=max(8.0, 2 * _store_gb(loaded, longest)))),
            "disk": ChunkStore(
                StoreConfig(tier="disk", dir=scratch, disk_gb=max(64.0, 2 * _store_gb(loaded, longest)))
            ),
        }
        for index, segments in enumerate(prompts):
            ids = join_segments(segments)
            methods = []
            for label, cfg, tier in configs:
                method = create_method({**method_node(cfg.get("name", "full")), **cfg})
                if tier is not None:
                    assert isinstance(method, ReuseMethod)
                    method.attach_store(stores[tier])
                methods.append(((label, tier), method))
            times: dict[tuple[str, str | None], list[float]] = {key: [] for key, _ in methods}
            recomputed: dict[tuple[str, str | None], Any] = {}
            for round_ in range(repeats + 1):  # round 0 precomputes the chunks and warms up
                for key, method in methods:  # interleaved: a load change hits every config of a round alike
                    out = generate(loaded, method, ids, max_new_tokens=1, segments=segments, budget=BudgetConfig())
                    if round_:
                        times[key].append(out.telemetry["ttft_s"])
                        plan = out.telemetry.get("prefill") or {}
                        recomputed[key] = (plan.get("recompute_ratio"), plan.get("through_ratio"))
            full = times["full", None]
            for (label, tier), seconds in times.items():
                ratios = [s / f for s, f in zip(seconds, full)]
                share, through = recomputed.get((label, tier), (None, None))
                rows.append(
                    {
                        "prompt": index,
                        "tokens": len(ids),
                        "method": label,
                        "chunks from": tier or "-",
                        "recomputed": "-" if share is None else round(share, 3),
                        "through MLP": "-" if through is None else round(through, 3),
                        "ttft_s": round(statistics.median(seconds), 4),
                        "ratio to full": round(statistics.median(ratios), 3),
                    }
                )
    notes = [
        f"model {loaded.spec.name} on {loaded.spec.device}; prompts: {source}",
        f"{repeats} interleaved rounds (every config once per round) after a warm-up round that also precomputes "
        "the chunk caches (excluded from TTFT); ttft_s: median; ratio: median of the per-round ratios to full",
        "disk: one safetensors file per chunk, dropped from the page cache before each read (cold reads); ram: "
        "host memory (pinned on a GPU machine: a load is a host-to-device copy)",
        "recomputed: share of the prompt's rows whose K/V were computed, averaged over layers "
        "(telemetry.prefill.recompute_ratio); through MLP: of those, the rows that also ran attention, output "
        "projection and MLP (through_ratio: less at a check layer that cuts to the selected rows)",
        f"torch threads {__import__('torch').get_num_threads()}, load average {os.getloadavg()[0]:.2f} at the end",
    ]
    return BenchResult("reuse_ttft", "TTFT of reuse methods vs full prefill (same prompts, one process)", rows, notes)
