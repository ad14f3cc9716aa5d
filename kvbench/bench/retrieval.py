"""Benchmarks of the retrieval methods: index search vs exact scoring, k-means vs faiss, end to end.

Layouts follow Llama-3.1-8B (8 KV heads, 32 query heads, head_dim 128) unless a model is loaded.
Every comparison is measured in one process on the same inputs; the ratio columns are the figures.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvbench.bench import BenchOptions, BenchResult, bench_device, benchmark, niah_ids, time_call
from kvbench.methods.primitives import kmeans as kmeans_module
from kvbench.methods.primitives.kmeans import kmeans
from kvbench.methods.primitives.pq import pq_fit, pq_scores
from kvbench.methods.selection import topk_sorted

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128


def _keys(s: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(KV_HEADS, s, HEAD_DIM, generator=generator).to(device)


def _query(device: torch.device) -> torch.Tensor:
    return torch.randn(KV_HEADS, GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(device)


@benchmark("pq_search")
def pq_search(options: BenchOptions) -> BenchResult:
    """PQ scoring + top-k vs exact q·Kᵀ + top-k, per layer and decode step (k = s/10)."""
    device = bench_device(options)
    lengths = (2048, 8192) if options.quick else (8192, 32768, 131072)
    rows = []
    for m, b in ((2, 6), (4, 8)):
        for s in lengths:
            keys = _keys(s, device)
            book = pq_fit(keys[:, : min(s, 4096)], m, b, iters=3)  # codebook quality is irrelevant to speed
            codes = torch.randint(0, 2**b, (KV_HEADS, s, m), dtype=book.codes.dtype, device=device)
            q = _query(device)
            k = s // 10

            def exact() -> torch.Tensor:
                scores = torch.einsum("hgd,hnd->hgn", q, keys)
                return topk_sorted(torch.softmax(scores * HEAD_DIM**-0.5, -1).sum(1), k)

            def approx() -> torch.Tensor:
                scores = pq_scores(q, book.centroids, codes)
                return topk_sorted(torch.softmax(scores * HEAD_DIM**-0.5, -1).sum(1), k)

            t_exact = time_call(exact, repeats=options.repeats, device=device)
            t_pq = time_call(approx, repeats=options.repeats, device=device)
            rows.append(
                {
                    "m×b": f"{m}×{b}",
                    "s": s,
                    "exact_ms": 1e3 * t_exact,
                    "pq_ms": 1e3 * t_pq,
                    "pq/exact": t_pq / t_exact,
                    "bytes pq/exact": m * b / 8 / (HEAD_DIM * 4),
                }
            )
    notes = [
        f"device {device}; one layer: {KV_HEADS} KV heads × {GROUP} query heads, d_h {HEAD_DIM}, fp32 keys",
        "bytes pq/exact: code bytes read per token vs fp32 key bytes (what each method must have on the device)",
    ]
    return BenchResult("pq_search", "PQ search + top-k vs exact scoring + top-k", rows, notes)


@benchmark("kmeans_faiss")
def kmeans_faiss(options: BenchOptions) -> BenchResult:
    """One layer's PQ construction: kvbench's batched k-means vs faiss-cpu, same keys and iterations.

    Both sides produce what PQCache needs, centroids and codes: kvbench's ``kmeans`` ends with an
    assignment, so faiss's ``train`` is followed by a search for the labels. Each comparison runs at
    the process's torch thread count (faiss set to the same) and, when that is more than one, again
    single-threaded: on a shared CPU the single-threaded ratio is the steadier figure."""
    try:
        import faiss
    except ImportError:
        return BenchResult("kmeans_faiss", "batched k-means vs faiss", [], ["skipped: faiss-cpu is not installed"])
    device = torch.device("cpu")
    lengths = (2048,) if options.quick else (8192, 32768)
    threads = torch.get_num_threads()
    faiss_threads = faiss.omp_get_max_threads()
    rows = []
    try:
        for count in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(count)
            faiss.omp_set_num_threads(count)
            for m, b, iters in ((2, 6, 10), (4, 8, 10)):
                for s in lengths:
                    keys = _keys(s, device)
                    sub = HEAD_DIM // m
                    problems = keys.reshape(KV_HEADS, s, m, sub).permute(0, 2, 1, 3).reshape(KV_HEADS * m, s, sub)
                    problems = problems.contiguous()
                    arrays = [p.numpy() for p in problems]

                    def ours() -> None:
                        kmeans(problems, 2**b, iters=iters, seed=0)

                    def theirs() -> None:
                        for array in arrays:
                            km = faiss.Kmeans(
                                sub,
                                2**b,
                                niter=iters,
                                seed=0,
                                verbose=False,
                                min_points_per_centroid=1,
                                max_points_per_centroid=10**9,
                            )
                            km.train(array)
                            km.index.search(array, 1)  # the codes

                    t_ours = time_call(ours, repeats=max(1, options.repeats // 2), device=device)
                    t_faiss = time_call(theirs, repeats=max(1, options.repeats // 2), device=device)
                    rows.append(
                        {
                            "threads": count,
                            "m×b": f"{m}×{b}",
                            "s": s,
                            "problems": KV_HEADS * m,
                            "iters": iters,
                            "kvbench_s": t_ours,
                            "faiss_s": t_faiss,
                            "kvbench/faiss": t_ours / t_faiss,
                        }
                    )
    finally:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(faiss_threads)
    notes = [
        f"CPU; threads: torch and faiss set alike per row (process default {threads})",
        "both sides return centroids and codes (faiss: train, then search for the labels)",
        "faiss clusters the problems one after another (its Kmeans has no batch dimension)",
        "kvbench with several threads: contiguous shares of the problems, one single-threaded call per thread "
        "(faiss: OpenMP inside each problem, a barrier per block; on a CPU shared with busy processes "
        "the single-threaded rows are the steadier figure)",
        "kvbench scores with oneDNN's fp32 linear: "
        + ("yes" if kmeans_module._onednn_linear() is not None else "no (MKL bmm)"),
        "faiss is not kvbench's CPU default: it splits the largest cluster into an empty one and never stops "
        "early, neither PQCache's scikit-learn rules nor ClusterKV's kept empty centroids (kmeans.py notes)",
    ]
    return BenchResult("kmeans_faiss", "batched k-means vs faiss-cpu (one layer's PQ construction)", rows, notes)


@benchmark("quest_scoring")
def quest_scoring(options: BenchOptions) -> BenchResult:
    """Quest's page scores per layer and decode step, ``method.scoring`` products vs gemv side by side, on
    the 7B MHA layout (32 KV heads) and the 8B GQA one (8 KV heads x 4), 16-token pages."""
    from kvbench.methods.quest import page_scores

    device = bench_device(options)
    lengths = (8192,) if options.quick else (8192, 32768, 131072)
    rows = []
    for layout, kv_heads, group in (("7B MHA", 32, 1), ("8B GQA", KV_HEADS, GROUP)):
        for s in lengths:
            generator = torch.Generator().manual_seed(s)
            pairs = torch.randn(kv_heads, s // 16, 2, HEAD_DIM, generator=generator).to(device)
            bounds = torch.stack([pairs.amin(dim=2), pairs.amax(dim=2)], dim=2)
            q = torch.randn(kv_heads, group, HEAD_DIM, generator=generator).to(device)
            t = {
                scoring: time_call(
                    functools.partial(page_scores, q, bounds, scoring), repeats=options.repeats, device=device
                )
                for scoring in ("products", "gemv")
            }
            gap = (page_scores(q, bounds, "gemv") - page_scores(q, bounds, "products")).abs().max().item()
            rows.append(
                {
                    "layout": layout,
                    "tokens": s,
                    "products_ms": 1e3 * t["products"],
                    "gemv_ms": 1e3 * t["gemv"],
                    "gemv / products": t["gemv"] / t["products"],
                    "max |difference|": gap,
                }
            )
    notes = [f"device {device}; one layer's scores of every page, float32 bounds; median of {options.repeats} runs"]
    return BenchResult("quest_scoring", "Quest's page scores: products vs gemv (method.scoring)", rows, notes)


@benchmark("clusterkv_select")
def clusterkv_select(options: BenchOptions) -> BenchResult:
    """ClusterKV's selection (centroid scores, cluster walk, trim) vs exact top-k, per layer and step."""
    from kvbench.methods.clusterkv import select_by_clusters

    device = bench_device(options)
    s = 8192 if options.quick else 32768
    clusters, budget = 400, 1024
    keys = _keys(s, device)
    labels = torch.randint(0, clusters, (KV_HEADS, s), generator=torch.Generator().manual_seed(2)).to(device)
    centroids = torch.randn(KV_HEADS, clusters, HEAD_DIM, device=device)
    slots = torch.arange(s, device=device)
    q = _query(device)
    per_head_labels = labels.repeat_interleave(GROUP, dim=0)

    def exact() -> torch.Tensor:
        return topk_sorted(torch.einsum("hgd,hnd->hgn", q, keys).reshape(KV_HEADS * GROUP, s), budget)

    def clustered() -> torch.Tensor:
        scores = torch.einsum("hgd,hcd->hgc", q, centroids).reshape(KV_HEADS * GROUP, clusters)
        return select_by_clusters(scores, per_head_labels, slots, budget)[0]

    t_exact = time_call(exact, repeats=options.repeats, device=device)
    t_cluster = time_call(clustered, repeats=options.repeats, device=device)
    rows = [
        {
            "s": s,
            "clusters": clusters,
            "budget": budget,
            "exact_topk_ms": 1e3 * t_exact,
            "clusterkv_ms": 1e3 * t_cluster,
            "clusterkv/exact": t_cluster / t_exact,
        }
    ]
    return BenchResult(
        "clusterkv_select",
        "ClusterKV selection vs exact top-k (per query head)",
        rows,
        [f"device {device}; {KV_HEADS * GROUP} query heads, d_h {HEAD_DIM}"],
    )


WARM_UP_TOKENS = 1024  # the e2e benches' untimed warm-up prompt (or the shortest length, if shorter)


def _e2e_rows(model_name: str, prompt: int, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per compared method (every key of ``runs`` but ``full``) at one prompt length, from the
    telemetry of each round: best TTFT, TT2T and latency over the rounds, the step split of the best-TPOT run."""
    methods = [method for method in runs if method != "full"]
    rows = []
    tt2t = {method: min(t["tt2t_s"] for t in tele) for method, tele in runs.items()}
    ttft = {method: min(t["ttft_s"] for t in tele) for method, tele in runs.items()}
    # a request's latency: prefill and every decode step (TTFT + the decode time), best of the rounds
    latency = {method: min(t["ttft_s"] + t["decode_s"] for t in tele) for method, tele in runs.items()}
    fastest = {method: min(tele, key=lambda t: t["tpot_s"]) for method, tele in runs.items()}
    tpot = {method: t["tpot_s"] for method, t in fastest.items()}
    for method in methods:
        split = fastest[method]
        steps = max(1, split["decode_steps"])
        quickest = min(runs[method], key=lambda t: t["tt2t_s"])
        row = {
            "model": model_name,
            "prompt": prompt,
            "method": method,
            "ttft_s": ttft[method],
            "full_ttft_s": ttft["full"],
            "tt2t_s": tt2t[method],
            "full_tt2t_s": tt2t["full"],
            "tt2t ratio": tt2t[method] / tt2t["full"],
            "tt2t / full ttft": tt2t[method] / ttft["full"],
            "latency_s": latency[method],
            "full_latency_s": latency["full"],
            "tpot_ms": 1e3 * tpot[method],
            "full_tpot_ms": 1e3 * tpot["full"],
            "tpot ratio": tpot[method] / tpot["full"],
            "select_ms": 1e3 * split["select_s"] / steps,
            "fetch_ms": 1e3 * split["fetch_s"] / steps,
            "compute_ms": 1e3 * split["compute_s"] / steps,
            "decode tok/s": 1 / tpot[method],
            "decode speedup": tpot["full"] / tpot[method],
        }
        if "wait_kmeans_s" in quickest.get("method", {}):  # PQCache: the wait for clustering in its TT2T
            row["wait_kmeans_s"] = quickest["method"]["wait_kmeans_s"]
        rows.append(row)
    return rows


def _e2e(
    options: BenchOptions,
    methods: list[tuple[str, dict[str, Any]]],
    lengths: tuple[int, ...],
    title: str,
    name: str,
    new_tokens: int = 32,
) -> BenchResult:
    """TT2T and TPOT of methods vs full on a real model (SmolLM2; tiny_llama in quick mode; ``--model``,
    ``--lengths`` and ``--new-tokens`` override, e.g. ``llama31_8b_shape`` at 32k-128k on a GPU).

    Each round runs full and then every method, so that a shared machine's changing load falls on
    all of them alike; each method keeps its best TT2T and TPOT over the rounds. A decode step's time
    splits into ``select_ms`` (the method's selection), ``fetch_ms`` (gathering the selected K/V through
    the store) and ``compute_ms`` (the rest: the model's layers and attention), per step, from the run
    with the best TPOT. ``--rounds`` sets the rounds (default 2; 1 with ``--quick``); ``--param KEY=VALUE``
    sets a parameter of the compared method (not of ``full``), e.g. ``kmeans_device=model``."""
    from kvbench.budget import BudgetConfig
    from kvbench.compose import compose
    from kvbench.engine.generate import generate
    from kvbench.methods import create_method
    from kvbench.models.loading import load_model

    model_name, lengths, new_tokens = options.e2e(
        "tiny_llama" if options.quick else "smollm2_135m", lengths, new_tokens
    )
    rounds = options.e2e_rounds()
    for method, _ in methods:  # a bad --param fails here, before the model loads
        create_method({**options.params, "name": method})
    loaded = load_model(compose([f"model={model_name}"])["model"])

    def run(name: str, budget: dict[str, Any], ids: list[int], n: int) -> dict[str, Any]:
        method = create_method({"name": name} if name == "full" else {**options.params, "name": name})
        out = generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, budget=BudgetConfig(**budget))
        return out.telemetry

    # one untimed warm-up per method, so that no timed run pays for kernel loading, allocator growth,
    # library handles or PQCache's cost-model fit (which is cached after its first fit)
    warm_ids = niah_ids(loaded, min(WARM_UP_TOKENS, min(lengths)))
    for method, budget in [("full", {})] + methods:
        run(method, budget, warm_ids, 2)
    rows = []
    for length in lengths:
        ids = niah_ids(loaded, length)
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(rounds):
            for method, budget in [("full", {})] + methods:
                runs.setdefault(method, []).append(run(method, budget, ids, new_tokens))
        rows.extend(_e2e_rows(model_name, len(ids), runs))
    notes = [
        f"{new_tokens} new tokens, best of {rounds} round(s) (full, then each method), after one untimed "
        f"warm-up run of each ({min(WARM_UP_TOKENS, min(lengths))} tokens, 2 new); "
        "TPOT = mean of decode steps after the first",
        "select/fetch/compute_ms: per decode step (every step, the first included), from the best-TPOT run; "
        "TTFT and TT2T: best of the rounds; tt2t / full ttft: PQCache's goal is at most 1.1; latency_s: a "
        "request's prefill and decode steps (TTFT + decode time), best of the rounds",
        f"device {loaded.spec.device}, {loaded.spec.dtype}; on a CPU both KV tiers are host memory",
    ] + ([f"method parameters: {options.params}"] if options.params else [])
    return BenchResult(name, title, rows, notes)


@benchmark("pqcache_e2e")
def pqcache_e2e(options: BenchOptions) -> BenchResult:
    lengths = (1024,) if options.quick else (4096, 8000)
    budget = {"token_ratio": 0.2, "comm_ratio": 1 / 128}
    return _e2e(options, [("pqcache", budget)], lengths, "TT2T and TPOT: pqcache vs full", "pqcache_e2e")


@benchmark("clusterkv_e2e")
def clusterkv_e2e(options: BenchOptions) -> BenchResult:
    lengths = (1024,) if options.quick else (8000,)
    budget = {"tokens": 256 if options.quick else 1024}
    return _e2e(options, [("clusterkv", budget)], lengths, "decode step: clusterkv vs full", "clusterkv_e2e")


@benchmark("quest_clusterkv_e2e")
def quest_clusterkv_e2e(options: BenchOptions) -> BenchResult:
    """ClusterKV's Fig. 13(b): the latency of ClusterKV against Quest's at one budget (1024 tokens; 256 with
    ``--quick``), each beside full in the same rounds (:func:`_e2e`: full, Quest, ClusterKV per round)."""
    lengths = (1024,) if options.quick else (8000,)
    budget = {"tokens": 256 if options.quick else 1024}
    methods = [("quest", budget), ("clusterkv", budget)]
    return _e2e(options, methods, lengths, "latency: clusterkv vs quest (and full)", "quest_clusterkv_e2e")


@benchmark("oracle_e2e")
def oracle_e2e(options: BenchOptions) -> BenchResult:
    """The exact top-k selector at PQCache's budget: what selection costs when its scores are exact
    (one q·K pass over every held key per layer and step) and nothing is offloaded."""
    lengths = (1024,) if options.quick else (4096, 8000)
    budget = {"token_ratio": 0.2}
    return _e2e(options, [("oracle", budget)], lengths, "TT2T and TPOT: oracle vs full", "oracle_e2e")
