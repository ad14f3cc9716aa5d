"""kvbench bench: the benchmarks run in this process (``kvbench_in_process``); an unknown benchmark's exit
status is checked on a real ``python -m kvbench`` process."""

import json
import math
import subprocess
import sys

from .conftest import kvbench_in_process as kvbench


def test_quick_benchmarks_run_and_report_ratios():
    names = ["pq_search", "kmeans_faiss", "clusterkv_select", "pqcache_e2e", "clusterkv_e2e", "oracle_e2e"]
    names.append("quest_clusterkv_e2e")
    out = kvbench("bench", "--quick", "--repeats", "1", "--json", *names)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    by_name = {r["name"]: r for r in report["results"]}
    assert set(by_name) == set(names)
    assert all(row["pq/exact"] > 0 for row in by_name["pq_search"]["rows"])
    assert all(row["kvbench/faiss"] > 0 for row in by_name["kmeans_faiss"]["rows"])
    assert by_name["clusterkv_select"]["rows"][0]["clusterkv/exact"] > 0
    for name in ("pqcache_e2e", "clusterkv_e2e", "oracle_e2e"):
        row = by_name[name]["rows"][0]
        assert row["tt2t_s"] > 0 and row["tpot ratio"] > 0
        assert row["latency_s"] > row["tt2t_s"] and row["full_latency_s"] > row["full_tt2t_s"]  # + the later steps
        assert row["select_ms"] > 0 and row["fetch_ms"] > 0 and row["compute_ms"] > 0  # the step's split
        assert row["select_ms"] + row["fetch_ms"] + row["compute_ms"] >= row["tpot_ms"] * 0.5
    both = by_name["quest_clusterkv_e2e"]["rows"]  # ClusterKV Fig. 13b: both methods, same prompt, same full
    assert [r["method"] for r in both] == ["quest", "clusterkv"]
    assert both[0]["full_latency_s"] == both[1]["full_latency_s"] and both[1]["latency_s"] > both[1]["tt2t_s"]


def test_unknown_benchmark_is_one_error_line():
    out = subprocess.run(
        [sys.executable, "-m", "kvbench", "bench", "nope"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stderr.startswith("kvbench: error: unknown benchmark")


def test_end_to_end_settings_can_be_chosen_and_the_record_saved(tmp_path):
    saved = tmp_path / "bench.json"
    out = kvbench(
        "bench",
        "pqcache_e2e",
        "--quick",
        "--save",
        str(saved),
        "--model",
        "tiny_qwen2",
        "--lengths",
        "700,900",
        "--new-tokens",
        "4",
        "--rounds",
        "2",
        "--param",
        "kmeans_iters=3",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("## pqcache_e2e")  # the table is printed, the record goes to the file
    record = json.loads(saved.read_text())
    assert record["cpus"] >= 1 and record["torch"]
    rows = record["results"][0]["rows"]
    assert [r["model"] for r in rows] == ["tiny_qwen2"] * 2
    assert 690 < rows[0]["prompt"] <= 700 and 890 < rows[1]["prompt"] <= 900
    for row in rows:  # TT2T against full's TTFT (PQCache's goal), and the wait for clustering inside it
        assert 0 < row["ttft_s"] <= row["tt2t_s"] and row["wait_kmeans_s"] >= 0
        assert math.isclose(row["tt2t / full ttft"], row["tt2t_s"] / row["full_ttft_s"])
    notes = " ".join(record["results"][0]["notes"])
    assert "best of 2 round(s)" in notes and "warm-up run of each (700 tokens, 2 new)" in notes
    assert "method parameters: {'kmeans_iters': 3}" in notes
    # bad settings: one error line naming the option, exit 2, before any model loads
    for option, value in [("--lengths", "32k"), ("--rounds", "0"), ("--param", "kmeans_iters"), ("--param", "nope=1")]:
        bad = kvbench("bench", "pqcache_e2e", option, value)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and (option in bad.stderr or "method.nope" in bad.stderr)


def test_reuse_ttft_reports_every_config_against_full():
    """reuse_ttft on a tiny model: full, cacheblend and full_reuse from both tiers, prefix_cache from RAM,
    ratios from paired rounds."""
    out = kvbench("bench", "reuse_ttft", "--quick", "--repeats", "1", "--json", "--model", "tiny_llama")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"][0]["rows"]
    assert [(r["method"], r["chunks from"]) for r in rows] == [
        ("full", "-"),
        ("cacheblend@0.15", "ram"),
        ("cacheblend@0.15 check_rows=all", "ram"),
        ("full_reuse", "ram"),
        ("cacheblend@0.15", "disk"),
        ("full_reuse", "disk"),
        ("prefix_cache", "ram"),
    ]
    assert rows[0]["ratio to full"] == 1 and all(r["ttft_s"] > 0 and r["ratio to full"] > 0 for r in rows)


def test_overhead_compares_full_with_transformers_and_times_the_run_loop():
    """overhead --quick on tiny_llama: kvbench's full is token-identical to transformers' greedy
    decoding, both ratios are measured, and the run loop's shares are fractions of a sample's wall."""
    out = kvbench("bench", "overhead", "--quick", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["metric"]: r for r in json.loads(out.stdout)["results"][0]["rows"]}
    assert rows["tokens_identical (HF greedy loop)"]["value"] is True
    assert rows["tokens_identical (model.generate)"]["value"] is True
    for metric in ("prefill ratio (kvbench TTFT / HF prefill)", "decode ratio (kvbench TPOT / HF TPOT)"):
        assert rows[metric]["value"] > 0 and rows[metric]["met"] == (rows[metric]["value"] <= 1.03)
    loop = rows["run-loop overhead / sample wall (median)"]["value"]
    outside = rows["  of which outside run_sample (sample building, record, log)"]["value"]
    inside = rows["  of which inside run_sample, outside prefill+decode"]["value"]
    assert 0 <= outside <= 1 and 0 <= inside <= 1 and 0 < loop < 1
    assert rows["run-loop overhead / sample wall (max)"]["value"] >= loop


def test_cost_vs_length_fits_exponents_and_saves_a_figure(tmp_path):
    """cost_vs_length --quick: a row per method and length, finite TPOT exponents, a select exponent
    for the retrieval method only, and the log-log figure beside the saved record."""
    saved = tmp_path / "cost.json"
    out = kvbench("bench", "cost_vs_length", "--quick", "--save", str(saved))
    assert out.returncode == 0, out.stderr
    rows = json.loads(saved.read_text())["results"][0]["rows"]
    assert [(r["method"], r["context"]) for r in rows] == [
        (m, n) for m in ("full", "quest", "streamingllm") for n in (rows[0]["context"], rows[1]["context"])
    ]
    assert rows[0]["context"] < rows[1]["context"]
    assert all(r["tpot_ms"] > 0 and math.isfinite(r["tpot exponent"]) for r in rows)
    assert all((r["select exponent"] is not None) == (r["method"] == "quest") for r in rows)
    assert all(math.isfinite(r["select exponent"]) and r["select_ms"] > 0 for r in rows if r["method"] == "quest")
    figure = tmp_path / "cost.cost_vs_length.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_host_counts_a_sync_free_static_step_and_decode_graph_runs_its_cpu_path(tmp_path):
    """decode_host --quick: full's step issues fewer ops than transformers' eager step, and neither full
    nor a selecting method reads back or changes its op stream between steps; decode_graph's CPU path
    (what benchmarks/gpu.sh decode_graph runs on a GPU) reports eager rows and marks graphs n/a."""
    out = kvbench(
        "bench", "decode_host", "decode_graph", "--quick", "--methods", "full,quest", "--rounds", "1", "--json"
    )
    assert out.returncode == 0, out.stderr
    by_name = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    rows = {row["method"]: row for row in by_name["decode_host"]["rows"]}
    assert set(rows) == {"hf_eager", "full", "quest"}
    assert rows["full"]["aten_ops"] < rows["hf_eager"]["aten_ops"]
    for name in ("full", "quest"):
        assert rows[name]["syncs"] == 0 and rows[name]["host_data"] == 0 and rows[name]["static"] == "yes"
    graph = {row["method"]: row for row in by_name["decode_graph"]["rows"]}
    assert graph["full"]["eager_tpot_ms"] > 0 and graph["full"]["graph_tpot_ms"] == "n/a (no CUDA)"
    assert graph["quest"]["tpot / full"] > 0


def test_decode_graph_runs_each_decode_kernel_side_by_side_and_profiles():
    """--param kernels=...: one row per kernel and method (what gpu.sh decode_8b compares on a GPU);
    --param profile=N prints each row's top ops from torch.profiler."""
    out = kvbench(
        "bench", "decode_graph", "--quick", "--methods", "full", "--rounds", "1", "--new-tokens", "4",
        "--param", "kernels=sdpa,split", "--param", "profile=3", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"][0]["rows"]
    assert [(row["method"], row["kernel"]) for row in rows] == [("full", "sdpa"), ("full", "split")]
    assert all(row["eager_tpot_ms"] > 0 for row in rows)
    assert out.stderr.count("decode_graph profile: full") == 2 and "Self CPU" in out.stderr


def test_a_decode_graph_method_entry_may_carry_its_own_parameters():
    """``--methods full,quest,quest:scoring=gemv`` (what gpu.sh decode_mha compares): one method twice with
    different parameters in one run; a malformed entry is one clear error."""
    import pytest

    from kvbench.bench.decode_graph import method_entry
    from kvbench.errors import ConfigError

    assert method_entry("quest") == ("quest", {})
    assert method_entry("quest:scoring=gemv:page_size=8") == ("quest", {"scoring": "gemv", "page_size": 8})
    with pytest.raises(ConfigError, match="name:key=value"):
        method_entry("quest:scoring")


def test_quest_scoring_times_both_scorings_on_the_same_bounds():
    """``kvbench bench quest_scoring``: per layout and length both scorings timed side by side, and the
    scores they give differ only by rounding."""
    out = kvbench("bench", "quest_scoring", "--quick", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"][0]["rows"]
    assert [(row["layout"], row["tokens"]) for row in rows] == [("7B MHA", 8192), ("8B GQA", 8192)]
    for row in rows:
        assert row["products_ms"] > 0 and row["gemv_ms"] > 0 and row["max |difference|"] < 1e-3
