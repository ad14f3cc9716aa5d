"""Run mypy on kvbench laid out as setuptools installs it (`make lint` calls this; plain `mypy` cannot).

pyproject.toml's [tool.setuptools.package-dir] installs methods/ as `kvbench.methods` and tasks/ as
`kvbench.tasks`. mypy has no such mapping (python/mypy#10564) and cannot see the editable install's import
hook, so on its own it names methods/full.py `methods.full` and reports every `from kvbench.methods import
...` as a missing module. This wrapper runs mypy's own option parsing and build with one change: each source
file's module name is derived through the package-dir mapping, so mypy checks the package Python imports, and
its messages keep the files' real paths. Options come from [tool.mypy] as usual. (mypy.main.main itself
cannot be hooked: mypy ships compiled with mypyc, so it calls its helpers directly.)

    python tools/typecheck.py [mypy options]

Give it no files: mypy resolves ``kvbench.methods.*`` and ``kvbench.tasks.*`` only among its sources, so a
single file of methods/ or tasks/ cannot be checked alone; [tool.mypy] ``files`` names the packages (a warm
run, with mypy's cache, takes a second or two).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.util import count_stats

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[Path, str]:
    """Directory -> package name, for each [tool.setuptools.package-dir] entry that holds Python code."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {ROOT / d: pkg for pkg, d in mapping.items() if (ROOT / d / "__init__.py").is_file()}


def module_name(path: Path, dirs: dict[Path, str]) -> str | None:
    """`path`'s module name under the package-dir mapping (the deepest mapped directory holding it), or None."""
    path = path.resolve()
    holders = [d for d in dirs if path.is_relative_to(d)]
    if not holders:
        return None
    root = max(holders, key=lambda d: len(d.parts))
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([dirs[root], *parts])


def main() -> None:
    dirs = package_dirs()
    fscache = FileSystemCache()
    sources, options = process_options(sys.argv[1:], fscache=fscache)
    for source in sources:
        name = module_name(Path(source.path), dirs) if source.path else None
        if name is not None:
            source.module, source.base_dir = name, str(ROOT)
    _, messages, blockers = run_build(sources, options, fscache, time.time(), sys.stdout, sys.stderr)
    n_errors, _, n_files = count_stats(messages)
    if n_errors:
        print(f"Found {n_errors} errors in {n_files} files (checked {len(sources)} source files)")
    else:
        print(f"Success: no issues found in {len(sources)} source files")
    sys.exit(2 if blockers else 1 if n_errors else 0)


if __name__ == "__main__":
    main()
