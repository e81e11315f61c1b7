"""Image sources: SIF, sandbox directory, docker-archive:, docker:// (from a registry on 127.0.0.1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hermes_env_singularity.backend import SingularityEnvironment
from hermes_env_singularity.images import cache_key
from singularity_support import IMAGE_ENV, LocalRegistry

from hermes_env_core.errors import ConfigError

MARKER = "cat /marker; echo \"$HERMES_IMAGE_ENV\""


def test_local_sif(sif: Path) -> None:
    with SingularityEnvironment(image=str(sif)) as env:
        assert env.image.kind == "sif"
        r = env.execute(MARKER)
    # A SIF built from a plain directory has no image environment.
    assert r.output == "hermes-test-image\n\n"


def test_sandbox_directory(sandbox: Path) -> None:
    with SingularityEnvironment(image=str(sandbox)) as env:
        assert env.image.kind == "sandbox"
        assert env.execute("cat /marker; echo changed > /marker; cat /marker").output == "hermes-test-image\nchanged\n"
    # --writable-tmpfs: the sandbox itself is untouched.
    assert (sandbox / "marker").read_text() == "hermes-test-image\n"


def test_plain_directory_is_refused_with_the_fix(rootfs: Path) -> None:
    with pytest.raises(ConfigError, match=r"not an Apptainer sandbox.*apptainer build"):
        SingularityEnvironment(image=str(rootfs))


def test_missing_image_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a file or directory"):
        SingularityEnvironment(image=str(tmp_path / "nope.sif"))


def test_docker_archive_built_once_into_the_cache(docker_archive: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with SingularityEnvironment(image=f"docker-archive:{docker_archive}", cache_dir=str(cache)) as env:
        assert env.image.kind == "built"
        assert env.image.source == str(cache / cache_key(f"docker-archive:{docker_archive}"))
        assert env.execute(MARKER).output == f"hermes-test-image\n{IMAGE_ENV['HERMES_IMAGE_ENV']}\n"
    sifs = sorted(p.name for p in cache.iterdir() if p.suffix == ".sif")
    assert len(sifs) == 1, sifs
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    with SingularityEnvironment(image=f"docker-archive:{docker_archive}", cache_dir=str(cache)) as env:
        assert env.image.kind == "cached"
        assert env.execute("cat /marker").output == "hermes-test-image\n"


def test_stale_temporary_build_is_removed(docker_archive: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    ref = f"docker-archive:{docker_archive}"
    stale = cache / f".{cache_key(ref)}.99999.tmp"  # left by a build that was killed
    stale.write_bytes(b"half a SIF")
    with SingularityEnvironment(image=ref, cache_dir=str(cache)) as env:
        assert env.image.kind == "built"
    assert not stale.exists()


def test_docker_archive_key_follows_the_file(docker_archive: Path, tmp_path: Path) -> None:
    copy = tmp_path / "img.tar"
    copy.write_bytes(docker_archive.read_bytes())
    before = cache_key(f"docker-archive:{copy}")
    assert cache_key(f"docker-archive:{copy}") == before
    os.utime(copy, ns=(1, 1))
    assert cache_key(f"docker-archive:{copy}") != before


def test_docker_reference_built_once(rootfs: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with LocalRegistry(rootfs) as registry:
        opts = dict(image=registry.reference, cache_dir=str(cache), no_https=True)
        with SingularityEnvironment(**opts) as env:
            assert env.image.kind == "built", env.image
            assert env.execute(MARKER).output == f"hermes-test-image\n{IMAGE_ENV['HERMES_IMAGE_ENV']}\n"
        pulls = registry.manifest_requests
        assert pulls >= 1
        with SingularityEnvironment(**opts) as env:
            assert env.image.kind == "cached"
            assert env.execute("cat /marker").output == "hermes-test-image\n"
        assert registry.manifest_requests == pulls, "the cached SIF was not reused"


def test_cache_dir_from_apptainer_cachedir(docker_archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPTAINER_CACHEDIR", str(tmp_path / "apptainer-cache"))
    with SingularityEnvironment(image=f"docker-archive:{docker_archive}") as env:
        assert env.image.source.startswith(str(tmp_path / "apptainer-cache" / "hermes-env") + os.sep)
        assert os.path.isfile(env.image.source)


def test_failed_build_falls_back_to_the_reference_with_a_warning(docker_archive: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ref = f"docker-archive:{docker_archive}"
    # A build that cannot finish in time fails; running the reference directly still works.
    with SingularityEnvironment(image=ref, cache_dir=str(cache), build_timeout=0.01) as env:
        assert env.image.kind == "direct" and env.image.source == ref
        r = env.execute("cat /marker")
        assert r.output == "hermes-test-image\n"
        assert any("could not be built" in n and "did not finish" in n and "directly" in n for n in r.notes), r.notes
        assert not any("could not be built" in n for n in env.execute("true").notes), "the warning repeats"
    assert not list(cache.glob("*.sif")) and not list(cache.glob("*.tmp"))


def test_unusable_cache_dir_falls_back(docker_archive: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with SingularityEnvironment(image=f"docker-archive:{docker_archive}", cache_dir=str(blocker / "sub")) as env:
        assert env.image.kind == "direct"
        r = env.execute("cat /marker")
    assert r.output == "hermes-test-image\n"
    assert any("could not be built" in n for n in r.notes)


def test_missing_archive_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.tar cannot be read"):
        SingularityEnvironment(image=f"docker-archive:{tmp_path / 'missing.tar'}", cache_dir=str(tmp_path))


def test_broken_archive_raises_with_both_failures(tmp_path: Path) -> None:
    from hermes_env_core.errors import EnvironmentUnavailable

    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tarball")
    with pytest.raises(EnvironmentUnavailable, match=r"(?s)instance start.*could not be built"):
        SingularityEnvironment(image=f"docker-archive:{bad}", cache_dir=str(tmp_path / "cache"))
