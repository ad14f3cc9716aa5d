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
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from kvbench.bench import BenchOptions, BenchResult, benchmark

CHUNK = 560
CONFIGS: tuple[tuple[str, dict[str, Any], str | None], ...] = (
    ("full", {}, None),
    ("cacheblend@0.15", {"name": "cacheblend", "recompute_ratio": 0.15}, "ram"),
    ("full_reuse", {"name": "full_reuse"}, "ram"),
    ("cacheblend@0.15", {"name": "cacheblend", "recompute_ratio": 0.15}, "disk"),
    ("full_reuse", {"name": "full_reuse"}, "disk"),
    ("prefix_cache", {"name": "prefix_cache"}, "ram"),  # hits the prefix and the first chunk only
)


def _prompts(loaded: Any, count: int, chunk: int = CHUNK) -> tuple[list[Any], str]:
    """``count`` chunked prompts (tuples of Segments) and where they come from (synthetic chunks of
    ``chunk`` tokens)."""
    from kvbench.requests import Segment

    folder = os.environ.get("KVBENCH_RAG_DATA")
    if folder:
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
    for p in range(count):
        start = p * 10 * chunk
        chunks = [Segment(tuple(ids[start + i * chunk : start + (i + 1) * chunk]), "chunk") for i in range(10)]
        prompts.append((Segment(tuple(prefix), "prefix"), *chunks, Segment(tuple(question), "query")))
    return prompts, f"synthetic: essays cut into 10 chunks of {chunk} tokens"


@benchmark("reuse_ttft")
def reuse_ttft(options: BenchOptions) -> BenchResult:
    """TTFT of cacheblend@0.15 and full_reuse vs full on 10-chunk prompts, chunks from RAM and disk, and
    of prefix_cache (chunks from RAM)."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import generate
    from kvbench.kv.chunks import ChunkStore, StoreConfig
    from kvbench.methods import create_method, method_node
    from kvbench.methods.reuse import ReuseMethod
    from kvbench.models.loading import load_model
    from kvbench.requests import join_segments

    name, _, _ = options.e2e("smollm2_135m", (0,))
    from kvbench.compose import compose

    loaded = load_model(compose([f"model={name}"])["model"])
    count = 1 if options.quick else 3
    prompts, source = _prompts(loaded, count, 64 if options.quick else CHUNK)  # --quick: a smoke test
    repeats = max(1, min(options.repeats, 3))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        stores = {
            "ram": ChunkStore(StoreConfig(tier="ram", ram_gb=8.0)),
            "disk": ChunkStore(StoreConfig(tier="disk", dir=scratch, disk_gb=64.0)),
        }
        for index, segments in enumerate(prompts):
            ids = join_segments(segments)
            methods = []
            for label, cfg, tier in CONFIGS:
                method = create_method({**method_node(cfg.get("name", "full")), **cfg})
                if tier is not None:
                    assert isinstance(method, ReuseMethod)
                    method.attach_store(stores[tier])
                methods.append(((label, tier), method))
            times: dict[tuple[str, str | None], list[float]] = {key: [] for key, _ in methods}
            for round_ in range(repeats + 1):  # round 0 precomputes the chunks and warms up
                for key, method in methods:  # interleaved: a load change hits every config of a round alike
                    out = generate(loaded, method, ids, max_new_tokens=1, segments=segments, budget=BudgetConfig())
                    if round_:
                        times[key].append(out.telemetry["ttft_s"])
            full = times["full", None]
            for (label, tier), seconds in times.items():
                ratios = [s / f for s, f in zip(seconds, full)]
                rows.append(
                    {
                        "prompt": index,
                        "tokens": len(ids),
                        "method": label,
                        "chunks from": tier or "-",
                        "ttft_s": round(statistics.median(seconds), 4),
                        "ratio to full": round(statistics.median(ratios), 3),
                    }
                )
    notes = [
        f"model {loaded.spec.name} on {loaded.spec.device}; prompts: {source}",
        f"{repeats} interleaved rounds (every config once per round) after a warm-up round that also precomputes "
        "the chunk caches (excluded from TTFT); ttft_s: median; ratio: median of the per-round ratios to full",
        "disk: one safetensors file per chunk, dropped from the page cache before each read (cold reads)",
        f"torch threads {__import__('torch').get_num_threads()}, load average {os.getloadavg()[0]:.2f} at the end",
    ]
    return BenchResult("reuse_ttft", "TTFT of reuse methods vs full prefill (same prompts, one process)", rows, notes)
