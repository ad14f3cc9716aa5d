import json
import subprocess
import sys


def test_quick_benchmarks_run_and_report_ratios():
    names = ["pq_search", "kmeans_faiss", "clusterkv_select", "pqcache_e2e", "clusterkv_e2e", "oracle_e2e"]
    out = subprocess.run(
        [sys.executable, "-m", "kvbench", "bench", "--quick", "--repeats", "1", "--json", *names],
        capture_output=True,
        text=True,
        timeout=600,
    )
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
        assert row["select_ms"] > 0 and row["fetch_ms"] > 0 and row["compute_ms"] > 0  # the step's split
        assert row["select_ms"] + row["fetch_ms"] + row["compute_ms"] >= row["tpot_ms"] * 0.5


def test_unknown_benchmark_is_one_error_line():
    out = subprocess.run(
        [sys.executable, "-m", "kvbench", "bench", "nope"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stderr.startswith("kvbench: error: unknown benchmark")


def test_end_to_end_settings_can_be_chosen_and_the_record_saved(tmp_path):
    saved = tmp_path / "bench.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbench",
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
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("## pqcache_e2e")  # the table is printed, the record goes to the file
    record = json.loads(saved.read_text())
    assert record["cpus"] >= 1 and record["torch"]
    rows = record["results"][0]["rows"]
    assert [r["model"] for r in rows] == ["tiny_qwen2"] * 2
    assert 690 < rows[0]["prompt"] <= 700 and 890 < rows[1]["prompt"] <= 900
    bad = subprocess.run(
        [sys.executable, "-m", "kvbench", "bench", "pqcache_e2e", "--lengths", "32k"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--lengths" in bad.stderr and "Traceback" not in bad.stderr


def test_reuse_ttft_reports_every_config_against_full():
    """reuse_ttft on a tiny model: full and both reuse methods from both tiers, ratios from paired rounds."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbench",
            "bench",
            "reuse_ttft",
            "--quick",
            "--repeats",
            "1",
            "--json",
            "--model",
            "tiny_llama",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"][0]["rows"]
    assert [(r["method"], r["chunks from"]) for r in rows] == [
        ("full", "-"),
        ("cacheblend@0.15", "ram"),
        ("full_reuse", "ram"),
        ("cacheblend@0.15", "disk"),
        ("full_reuse", "disk"),
    ]
    assert rows[0]["ratio to full"] == 1 and all(r["ttft_s"] > 0 and r["ratio to full"] > 0 for r in rows)
