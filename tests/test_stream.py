"""The request-stream experiment (CacheBlend Fig. 14): Poisson arrivals, the FIFO replay, its statistics,
the rag_stream task, and the system figures of the rag task (Figs. 2, 13, 15, 17) from synthetic runs."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kvbench.errors import ConfigError
from kvbench.figures import rag, rag_system
from kvbench.report import FigureRun
from kvbench.stream import arrivals, rate_grid, replay, service_times, stream_stats
from kvbench.tasks import create_task
from kvbench.tasks.rag_stream import RagStream

from .test_rag import qa_dir  # noqa: F401 (fixture)


def _legend():
    """The legend the rag task's figures use (CacheBlend's)."""
    from kvbench.figures.legend import paper_legend
    from kvbench.tasks.rag import FIGURES_PAPER

    return paper_legend(FIGURES_PAPER)


def _with_legend(builder):
    """``builder`` (a kvbench.figures RAG builder) with the rag task's legend."""
    return lambda items: builder(items, _legend())


run_infos = _with_legend(rag.run_infos)
retrieval = _with_legend(rag_system.retrieval)
equal_quality_points = _with_legend(rag_system.equal_quality_points)
scaling = _with_legend(rag_system.scaling)
pipelines = _with_legend(rag_system.pipelines)
storage = _with_legend(rag_system.storage)


# ---------------------------------------------------------------------- arrivals and the queue
def test_poisson_arrivals_are_seeded_and_scale_with_the_rate():
    a = arrivals(20000, 4.0, seed=3)
    assert a[0] == 0 and np.all(np.diff(a) > 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03) and gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential
    assert np.allclose(arrivals(50, 2.0, seed=3), 2 * arrivals(50, 4.0, seed=3))  # one stream, every rate
    assert not np.allclose(arrivals(50, 2.0, seed=4), arrivals(50, 2.0, seed=3))
    with pytest.raises(ValueError):
        arrivals(3, 0.0)


def test_fifo_replay_golden():
    r = replay([0.0, 1.0, 1.5, 10.0], service=[2.0, 2.0, 1.0, 1.0], first_token=[1.0, 0.5, 0.5, 0.2])
    assert r.start.tolist() == [0.0, 2.0, 4.0, 10.0]
    assert r.finish.tolist() == [2.0, 4.0, 5.0, 11.0]
    assert r.wait.tolist() == [0.0, 1.0, 2.5, 0.0]
    assert r.ttft.tolist() == [1.0, 1.5, 3.0, 0.2]
    with pytest.raises(ValueError):
        replay([0.0], [1.0], [2.0])


def record(i, ttft, decode=0.0, precompute=0.0, warmup=False):
    return {
        "id": f"q{i}",
        "score": 50.0,
        "meta": {"stream_position": i, "warmup": warmup, "stream_seed": 0},
        "telemetry": {"ttft_s": ttft, "decode_s": decode, "prepared": {"precompute_s": precompute}},
    }


def test_service_times_count_chunk_misses_and_decode():
    service, first = service_times([record(0, 1.0, 0.5, precompute=2.0), record(1, 0.25, 0.25)])
    assert service.tolist() == [3.5, 0.5] and first.tolist() == [3.0, 0.25]


def test_stream_statistics_light_load_and_overload():
    records = [record(i, 0.1, 0.1, precompute=5.0 if i < 3 else 0.0, warmup=i < 3) for i in range(203)]
    light, heavy = stream_stats(records, [0.01, 1000.0], warmup=3, seed=1)
    # a light load never queues: TTFT is the request's own first-token time, throughput the arrival rate
    assert light["ttft_p50_s"] == pytest.approx(0.1) and light["wait_p50_s"] == 0.0
    assert light["throughput"] == pytest.approx(0.01, rel=0.15)
    # an overload saturates the server at 1 / service time; the cold warm-up requests are not counted
    assert heavy["throughput"] == pytest.approx(1 / 0.2, rel=1e-6) and heavy["utilisation"] == pytest.approx(1.0)
    assert heavy["ttft_p90_s"] > heavy["ttft_p50_s"] > 1.0 and heavy["requests"] == 200
    with pytest.raises(ValueError):
        stream_stats(records[:3], [1.0], warmup=3)


def test_rate_grid_spans_light_load_to_overload():
    grid = rate_grid([2.0, 0.5], points=5)
    assert grid[0] == pytest.approx(0.125) and grid[-1] == pytest.approx(2.5) and len(grid) == 5
    assert all(b > a for a, b in zip(grid, grid[1:]))


# ---------------------------------------------------------------------- the rag_stream task
#: the stream over musique with each passage one chunk and every passage retrieved (the task's defaults are
#: CacheBlend Fig. 14's 2WikiMQA, 512-token chunks, top 6)
WHOLE_PASSAGES = {"name": "rag_stream", "dataset": "musique", "chunk_tokens": None, "top_k": None}


def test_the_stream_repeats_questions_in_a_seeded_order_with_shuffled_chunks(tiny_llama, qa_dir):  # noqa: F811
    task = create_task({**WHOLE_PASSAGES, "data_dir": str(qa_dir), "repeats": 3, "warmup": 2, "seed": 5})
    ids = task.sample_ids()
    assert sorted(ids) == sorted(f"musique-{q}~{k}" for q in range(2) for k in range(3))
    assert (
        ids != sorted(ids)
        and ids == create_task({**WHOLE_PASSAGES, "data_dir": str(qa_dir), "repeats": 3, "seed": 5}).sample_ids()
    )
    samples = list(task.samples(tiny_llama))
    assert [s.id for s in samples] == ids
    assert [s.meta["warmup"] for s in samples] == [True, True, False, False, False, False]
    first = [s for s in samples if s.id.startswith("musique-0")]
    chunk_sets = [sorted(seg.ids for seg in s.segments if seg.role == "chunk") for s in first]
    assert chunk_sets[0] == chunk_sets[1] == chunk_sets[2] and len(chunk_sets[0]) == 6  # the same chunks ...
    orders = [s.meta["chunk_order"] for s in first]
    assert len({tuple(o) for o in orders}) > 1 and all(sorted(o) == list(range(6)) for o in orders)  # ... reordered
    assert [seg.role for seg in first[0].segments] == ["prefix"] + ["chunk"] * 6 + ["query"]
    limited = create_task({**WHOLE_PASSAGES, "data_dir": str(qa_dir), "limit": 1, "repeats": 2})
    assert sorted(limited.sample_ids()) == ["musique-0~0", "musique-0~1"]  # limit counts questions


@pytest.mark.parametrize(
    "cfg,needle",
    [
        ({"repeats": 0}, "task.repeats"),
        ({"warmup": -1}, "task.warmup"),
        ({"shuffle_chunks": "yes"}, "shuffle_chunks"),
        ({"pipeline": "mapreduce"}, "single prompts"),
    ],
)
def test_bad_stream_settings_are_refused(cfg, needle, qa_dir):  # noqa: F811
    with pytest.raises(ConfigError, match=needle):
        create_task({**WHOLE_PASSAGES, "data_dir": str(qa_dir), **cfg})


def test_a_stream_run_keeps_one_store_so_repeated_chunks_are_computed_once(tmp_path, qa_dir):  # noqa: F811
    args = [
        sys.executable,
        "-m",
        "kvbench",
        "run",
        "method=cacheblend",
        "method.miss=precompute",  # (counted as precomputed chunks; miss: prefill: test_cacheblend_miss.py)
        "task=rag_stream",
        "task.dataset=musique",
        f"task.data_dir={qa_dir}",
        "task.limit=2",
        "task.repeats=2",
        "task.warmup=1",
        "task.top_k=null",
        "task.chunk_tokens=null",
        "model=tiny_llama",
        "store.disk_gb=0",
        f"output_dir={tmp_path / 'runs'}",
        "progress=false",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["meta"]["stream_position"] for r in records] == [0, 1, 2, 3]
    computed = [r["telemetry"]["prepared"]["precomputed_chunks"] for r in records]
    seen, expected = set(), []
    for r in records:  # a question's second request finds its passages (and the prefix) already stored
        q = r["meta"]["question_id"]
        expected.append(0 if q in seen else None)
        seen.add(q)
    assert all(c == 0 for c, e in zip(computed, expected) if e == 0) and sum(computed) > 0
    figure = tmp_path / "fig14.png"
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbench",
            "report",
            str(tmp_path / "runs"),
            "--figure",
            str(figure),
            "--where",
            "task=rag_stream",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    assert figure.exists() and figure.with_suffix(".csv").exists()
    table = figure.with_suffix(".md").read_text()
    assert table.count("\n") == 2 + 8 and "ttft_p50_s" in table  # header, rule, one row per rate


def test_stream_figure_draws_one_line_per_run(tmp_path, monkeypatch):
    import kvbench.plots

    drawn = []
    monkeypatch.setattr(kvbench.plots, "_save", lambda fig, path: drawn.append(fig) or path)
    fast = [record(i, 0.2, 0.1, warmup=i < 2) for i in range(12)]
    slow = [record(i, 1.0, 0.1, warmup=i < 2) for i in range(12)]
    RagStream.comparison_figure([("cacheblend", fast), ("full", slow)], tmp_path / "s.png")
    (ax,) = drawn[0].axes
    assert len(ax.get_lines()) == 4  # p50 and p90 of each run
    # one legend line per run (below the axes) and the two line styles (in the axes)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["cacheblend", "full"]
    (styles,) = [a for a in ax.artists if a is not ax.get_legend()]
    assert [t.get_text() for t in styles.get_texts()] == ["p50 (solid)", "p90 (dashed)"]
    rows = [line for line in (tmp_path / "s.csv").read_text().splitlines()[1:]]
    assert len(rows) == 16
    with pytest.raises(ConfigError):
        RagStream.comparison_figure([("x", fast)], tmp_path / "t.png", kind="ratio")


# ---------------------------------------------------------------------- the system figures (synthetic runs)
def fake(method, scores, ttft, dataset="wikimqa", model="qwen25_05b", store=None, pipeline_ttft=None, **cfg):
    task = {"name": "rag", "dataset": dataset, "data_dir": "d", "pipeline": "stuff"}
    params = {"name": method}
    for key, value in cfg.items():
        group, name = key.split("__")
        (task if group == "task" else params)[name] = value
    if method == "cacheblend":
        params.setdefault("recompute_ratio", 0.15)
    records = []
    for i, s in enumerate(scores):
        tele = {"ttft_s": ttft, "prompt_tokens": 100}
        if pipeline_ttft is not None:
            tele["pipeline"] = {"ttft_parallel_s": pipeline_ttft}
        records.append({"id": f"{i}", "score": s, "telemetry": tele, "protocol": {"dataset": dataset}})
    config = {"model": {"name": model}, "method": params, "task": task}
    if store is not None:
        config["store"] = store
    return FigureRun(method, records, config)


def test_retrieval_figure_has_one_line_per_method_over_top_k():
    runs = [
        fake(m, [s, s + 10], 1.0, task__top_k=k, task__chunk_tokens=128)
        for m, base in (("full", 40), ("full_reuse", 20))
        for k, s in ((8, base + 5), (2, base), (4, base + 8))
    ]
    (panel,), title, caption, _ = retrieval(run_infos(runs))
    lines = {s.label: s for s in panel.series}
    assert set(lines) == {"Full KV recompute", "Full KV reuse"}
    assert lines["Full KV recompute"].x == [2, 4, 8] and lines["Full KV recompute"].y == [45, 53, 50]
    assert "128 tokens" in caption


def test_equal_quality_picks_the_smallest_ratio_within_the_bound():
    runs = []
    for k, full_f1 in ((2, 50.0), (4, 60.0)):
        runs.append(fake("full", [full_f1] * 2, 2.0 * k, task__top_k=k, task__chunk_tokens=512))
        for r, loss, t in ((0.05, 5.0, 0.3), (0.15, 1.4, 0.5), (0.3, 0.0, 0.8)):
            runs.append(
                fake(
                    "cacheblend",
                    [full_f1 - loss] * 2,
                    t * k,
                    method__recompute_ratio=r,
                    task__top_k=k,
                    task__chunk_tokens=512,
                )
            )
    runs.append(fake("full", [70.0] * 2, 9.0, task__top_k=4, task__chunk_tokens=256))
    runs.append(fake("cacheblend", [60.0] * 2, 1.0, method__recompute_ratio=0.3, task__top_k=4, task__chunk_tokens=256))
    points = {(p["chunk_tokens"], p["top_k"]): p for p in equal_quality_points(run_infos(runs))}
    assert points[(512, 2)]["ratio"] == 0.15 and points[(512, 2)]["cacheblend_ttft_s"] == pytest.approx(1.0)
    assert points[(512, 4)]["full_ttft_s"] == 8.0 and points[(256, 4)]["ratio"] is None  # 10 points below full
    panels, *_ = scaling(run_infos(runs))
    (a,) = [p for p in panels if p.title.startswith("(a)")]
    assert a.series[0].x == [2, 4] and a.series[1].notes == ["r=0.15", "r=0.15"]
    (b,) = [p for p in panels if p.title.startswith("(b)")]
    assert b.series[0].x == [256, 512] and "256" in b.note


def test_pipelines_figure_places_pipelines_beside_stuff_methods():
    runs = [
        fake("full", [50, 60], 4.0),
        fake("cacheblend", [48, 58], 1.0),
        fake("full", [30, 40], 9.0, task__pipeline="mapreduce", pipeline_ttft=3.0),
        fake("full", [20, 30], 3.0, task__pipeline="maprerank", pipeline_ttft=0.6),
    ]
    (panel,), *_ = pipelines(run_infos(runs))
    labels = {s.label: s for s in panel.series}
    assert labels["MapReduce"].x == [9.0] and labels["MapReduce, maps in parallel (ideal)"].x == [3.0]
    assert labels["MapRerank"].y == [25.0] and labels["Full KV recompute"].x == [4.0]
    with pytest.raises(ConfigError, match="task.pipeline"):
        pipelines(run_infos(runs[:2]))


def test_storage_figure_has_a_panel_per_device_with_full_in_each():
    disk = {"tier": "disk", "read_mbps": None}
    runs = [
        fake("full", [50], 4.0),
        fake("cacheblend", [48], 1.0, store={"tier": "ram", "read_mbps": None}),
        fake("cacheblend", [48], 1.5, store=disk),
        fake("cacheblend", [48], 3.0, store={"tier": "disk", "read_mbps": 50.0}),
        fake("cacheblend", [48], 2.0, store={"tier": "disk", "read_mbps": 500.0}),
        fake("full_reuse", [20], 1.2, store=disk),
    ]
    panels, *_ = storage(run_infos(runs))
    assert [p.title for p in panels] == [
        "RAM",
        "disk (cold reads)",
        "disk throttled to 500 MB/s",
        "disk throttled to 50 MB/s",
    ]
    assert all("Full KV recompute" in {s.label for s in p.series} for p in panels)
    assert {s.label: s.x for s in panels[1].series} == {
        "Full KV recompute": [4.0],
        "CacheBlend r=0.15": [1.5],
        "Full KV reuse": [1.2],
    }


def test_a_resumed_stream_replays_its_finished_requests_and_continues_as_one_run(tmp_path, qa_dir):  # noqa: F811
    """A request stream's later requests depend on the store the earlier ones left: a run stopped after its
    first request and resumed records what an uninterrupted run records (not an empty store's misses)."""
    from kvbench.compose import compose
    from kvbench.results import RunDir
    from kvbench.runner import run as run_config

    overrides = [
        "model=tiny_llama",
        "method=cachecraft",
        "task=rag_stream",
        "task.dataset=musique",
        f"task.data_dir={qa_dir}",
        "task.limit=1",
        "task.repeats=3",
        "task.warmup=0",
        "task.top_k=null",
        "task.chunk_tokens=48",
        "store.disk_gb=0",
        f"output_dir={tmp_path}",
        "progress=false",
    ]
    run_dir = RunDir(run_config(compose(overrides)).run_dir)
    whole = run_dir.records()
    reused = [r["telemetry"]["prefill"]["reused_tokens"] for r in whole]

    def plan(r):
        return [(c["action"], c["recomputed_tokens"]) for c in r["telemetry"]["method"]["cachecraft"]["chunks"]]

    assert len(whole) == 3 and {a for a, _ in plan(whole[0])} == {"miss"}
    assert all("miss" not in {a for a, _ in plan(r)} for r in whole[1:])  # the repeats find the first's chunks
    samples = run_dir.path / "samples.jsonl"
    samples.write_text(samples.read_text().splitlines(keepends=True)[0])
    assert run_config(compose(overrides)).ran == 2
    resumed = run_dir.records()
    assert [r["id"] for r in resumed] == [r["id"] for r in whole]
    assert [r["telemetry"]["prefill"]["reused_tokens"] for r in resumed] == reused
    assert [plan(r) for r in resumed] == [plan(r) for r in whole]
    assert [r["prediction"] for r in resumed] == [r["prediction"] for r in whole]
    log = (run_dir.path / "run.log").read_text()
    assert "replay: 1 samples served again, 1 answers as recorded" in log
