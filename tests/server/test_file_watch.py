"""``--reload-interval``'s file watcher: an in-place write, a Kubernetes-style link swap
(``..data`` pointing at a new folder) and a file that goes and comes back each run the reload
once, an unchanged look runs nothing; the flag rejects a non-positive interval."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tokenwire.server.cli import main
from tokenwire.server.file_watch import FileWatcher, signature, watched_paths


def _swap_link(folder: Path, target: str) -> None:
    """Point ``folder/..data`` at ``target`` in one rename, as the kubelet does."""
    tmp = folder / "..data_tmp"
    os.symlink(target, tmp)
    os.replace(tmp, folder / "..data")


def test_each_change_runs_the_reload_once(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pem"
    plain.write_text("one")
    mounted = tmp_path / "secret"
    for version in ("..v1", "..v2"):
        (mounted / version).mkdir(parents=True)
        (mounted / version / "keys.yaml").write_text("same size")
    _swap_link(mounted, "..v1")
    (mounted / "keys.yaml").symlink_to("..data/keys.yaml")
    calls: list[int] = []
    watcher = FileWatcher([str(plain), str(mounted / "keys.yaml")], lambda: calls.append(1))
    assert not watcher.check()  # nothing changed since construction
    plain.write_text("two, longer")  # in place
    assert watcher.check() and len(calls) == 1
    assert not watcher.check()
    _swap_link(mounted, "..v2")  # the kubelet's update: a new folder, one rename
    assert watcher.check() and len(calls) == 2
    plain.unlink()
    assert watcher.check() and len(calls) == 3
    assert not watcher.check()  # still absent: no change
    plain.write_text("back")
    assert watcher.check() and len(calls) == 4
    assert signature(str(tmp_path / "absent")) is None


def test_a_failing_reload_keeps_the_watch(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("one")
    calls: list[int] = []

    def reload() -> None:
        calls.append(1)
        raise RuntimeError("half-written file")

    watcher = FileWatcher([str(path)], reload)
    path.write_text("two, longer")
    assert watcher.check() and not watcher.check()
    path.write_text("three, longer still")
    assert watcher.check() and len(calls) == 2


def test_run_looks_periodically(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("one")

    async def scenario() -> None:
        changed = asyncio.Event()
        watcher = FileWatcher([str(path)], changed.set)
        task = asyncio.create_task(watcher.run(0.01))
        path.write_text("two, longer")
        try:
            await asyncio.wait_for(changed.wait(), timeout=10)
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_watched_paths_drop_none_and_repeats() -> None:
    assert watched_paths(["a.pem", None, "a.pem"], [None], ["keys.yaml"]) == ["a.pem", "keys.yaml"]


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_reload_interval_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--reload-interval", value])
    assert exited.value.code == 2
    assert "--reload-interval: must be a positive number of seconds" in capsys.readouterr().err
