"""Opening beneath a root: openat2 and its per-component fallback refuse every way out
(`..`, absolute and relative links, a linked folder); ConfinedSource reads what it opened."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hps.errors import SourceAccessError, SourceError, SourceNotFoundError
from hps.modelfiles.confined import (
    ConfinedSource,
    Escape,
    confined,
    current_roots,
    open_beneath,
    open_by_components,
)
from hps.modelfiles.uri import LocalSource, open_source

Opener = Callable[..., int]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/m/{good,abs,rel} (links out), root/out_link -> ../outside, outside/secret."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"s" * 1234)
    folder = tmp_path / "root" / "m"
    folder.mkdir(parents=True)
    (folder / "good").write_bytes(b"0123456789")
    (folder / "abs").symlink_to(tmp_path / "outside" / "secret")
    (folder / "rel").symlink_to(Path("..") / ".." / "outside" / "secret")
    (tmp_path / "root" / "out_link").symlink_to(Path("..") / "outside")
    return tmp_path


@pytest.fixture
def root_fd(tree: Path) -> Iterator[int]:
    fd = os.open(tree / "root", os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("opener", [open_beneath, open_by_components])
def test_inside_opens(opener: Opener, root_fd: int) -> None:
    fd = opener(root_fd, "m/good")
    try:
        assert os.pread(fd, 4, 2) == b"2345"
    finally:
        os.close(fd)
    os.close(opener(root_fd, "m", directory=True))


@pytest.mark.parametrize("opener", [open_beneath, open_by_components])
@pytest.mark.parametrize("path", ["m/abs", "m/rel", "out_link/secret", "../outside/secret",
                                  "m/../../outside/secret"])
def test_every_way_out_is_refused(opener: Opener, root_fd: int, path: str) -> None:
    with pytest.raises(Escape):
        os.close(opener(root_fd, path))


@pytest.mark.parametrize("opener", [open_beneath, open_by_components])
def test_missing_is_not_found(opener: Opener, root_fd: int) -> None:
    with pytest.raises(FileNotFoundError):
        opener(root_fd, "m/nope")


def test_confined_source_reads_its_descriptors(tree: Path) -> None:
    with ConfinedSource(str(tree / "root" / "m"), str(tree / "root" / "m"),
                        [str(tree / "root")]) as source:
        assert source.size("good") == 10
        assert source.read("good", 3, 4) == b"3456"
        assert source.names() == ["good"]  # links are not files of the folder here
        # the descriptor, not the path, is read: a file replaced after its open is not seen
        os.replace(tree / "outside" / "secret", tree / "root" / "m" / "good")
        assert source.read("good", 0, 10) == b"0123456789"
        for name in ("abs", "rel", "../m/good"):
            with pytest.raises(SourceAccessError) as refused:
                source.size(name)
            assert "1234" not in str(refused.value)
        with pytest.raises(SourceNotFoundError):
            source.size("nope")
        (tree / "root" / "m" / "key").mkdir()  # a folder where a model file should be
        with pytest.raises(SourceError, match="m/key' is a folder, not a model file"):
            source.size("key")


def test_a_linked_folder_leading_out_is_refused(tree: Path) -> None:
    with ConfinedSource("x", str(tree / "root" / "out_link"), [str(tree / "root")]) as source:
        with pytest.raises(SourceAccessError, match="leads out"):
            source.size("secret")
    with pytest.raises(SourceAccessError, match="not under an allowed root"):
        ConfinedSource("x", str(tree / "outside"), [str(tree / "root")])


def test_open_source_is_confined_only_inside_confined(tree: Path) -> None:
    folder = str(tree / "root" / "m")
    assert current_roots() is None
    assert isinstance(open_source(folder), LocalSource)
    inside = confined([str(tree / "root"), "s3://bucket/"], open_source, folder)
    assert isinstance(inside, ConfinedSource) and not isinstance(inside, LocalSource)
    inside.close()
    assert current_roots() is None
    assert isinstance(confined(None, open_source, folder), LocalSource)
