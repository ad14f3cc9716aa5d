"""benchmarks/rag_quality.py: the reuse-family table merges the shards of one run (rag_quality.sh runs
the sweep question by question, one shard per question) and compares methods on the same questions."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("rag_quality", ROOT / "benchmarks" / "rag_quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, name: str, method: dict, shard: str, rows: list[tuple[int, float, str]]) -> None:
    run = folder / name
    run.mkdir()
    config = {
        "model": {"name": "smollm2_135m"},
        "method": method,
        "task": {"name": "rag", "dataset": "musique", "limit": 4, "shard": shard},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with open(run / "samples.jsonl", "w") as handle:
        for index, score, prediction in rows:
            record = {"id": f"musique-{index}", "score": score, "prediction": prediction, "telemetry": {"ttft_s": 1.0}}
            handle.write(json.dumps(record) + "\n")


def test_shards_merge_and_only_questions_every_method_finished_count(tmp_path, capsys):
    full, blend = {"name": "full"}, {"name": "cacheblend", "recompute_ratio": 0.15}
    _run(tmp_path, "full-0", full, "0/4", [(0, 100.0, "a")])
    _run(tmp_path, "full-1", full, "1/4", [(1, 50.0, "b")])
    _run(tmp_path, "full-2", full, "2/4", [(2, 0.0, "c")])
    _run(tmp_path, "blend-0", blend, "0/4", [(0, 100.0, "a")])
    _run(tmp_path, "blend-1", blend, "1/4", [(1, 0.0, "x")])  # question 2 not finished by cacheblend
    _script().main([str(tmp_path), "--figure", str(tmp_path / "f1.png")])
    out = capsys.readouterr().out
    assert (tmp_path / "f1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "smollm2_135m, musique: 2 questions" in out  # shards merged; question 2 left out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["full"].split("|")[2].strip().startswith("75.0")
    assert rows["cacheblend@0.15"].split("|")[2].strip().startswith("50.0")
    assert rows["cacheblend@0.15"].split("|")[4].strip() == "50%"  # answer equals full's on question 0 only
    assert "(mcnemar)" not in rows["cacheblend@0.15"]  # full's 50.0 is not 0/100: the permutation test


def test_all_or_nothing_scores_name_the_exact_mcnemar_test(tmp_path, capsys):
    _run(tmp_path, "full-0", {"name": "full"}, "0/2", [(0, 100.0, "a"), (1, 100.0, "b")])
    _run(tmp_path, "reuse-0", {"name": "full_reuse"}, "0/2", [(0, 0.0, "x"), (1, 100.0, "b")])
    _script().main([str(tmp_path)])
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "p=1 (mcnemar)" in rows["full_reuse"]  # one discordant pair: 2 * 1/2, capped at 1
