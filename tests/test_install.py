"""`pip install .` (not editable) ships the engine, methods, tasks and configs."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_regular_install_works_from_any_directory(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr
    files = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
    for needed in (
        "kvbench/cli.py",
        "kvbench/sweep.py",
        "kvbench/render/table.py",
        "kvbench/figures/rag.py",
        "kvbench/methods/oracle.py",
        "kvbench/tasks/niah.py",
        "kvbench/conf/config.yaml",
        "kvbench/conf/model/smollm2_135m.yaml",
        "kvbench/methods/params.py",
        "kvbench/papers_data/pqcache.yaml",
    ):
        assert needed in files, needed
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import kvbench, kvbench.cli as c;"
        "assert kvbench.__file__.startswith(sys.argv[1]), kvbench.__file__;"
        "import kvbench.papers as p; assert str(p.papers_dir()).startswith(sys.argv[1]);"
        "assert p.load_paper('pqcache').artifacts;"
        "sys.exit(c.main(['list']))"
    )
    listed = subprocess.run(
        [sys.executable, "-c", probe, str(target)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    assert "streamingllm" in listed.stdout and "smollm2_135m" in listed.stdout


def test_import_kvbench_stays_light():
    code = (
        "import sys, kvbench, kvbench.budget, kvbench.results;"
        "bad = {'faiss', 'datasets', 'transformers'} & set(sys.modules); print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
