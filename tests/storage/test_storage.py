"""The storage contract: atomic publish, checksums, locks and the production pointer."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from modelship.storage import (
    ArtifactNotFoundError,
    ChecksumMismatchError,
    Storage,
    hash_inputs,
    intact_artifact,
    read_manifest,
    slugify,
    verify_artifact,
)


def publish_files(storage: Storage, artifact: Path, files: dict[str, bytes]) -> None:
    with (
        storage.lock(artifact),
        storage.publish(
            artifact, kind="test", source="unit", revision=None, inputs_hash=hash_inputs(files)
        ) as staging,
    ):
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)


def test_publish_writes_manifest_with_checksums(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    artifact = storage.base_dir("m")
    publish_files(storage, artifact, {"a.bin": b"abc", "sub/b.txt": b"hello"})

    manifest = verify_artifact(artifact, full=True)
    assert manifest.kind == "test"
    assert {f.path: f.size for f in manifest.files} == {"a.bin": 3, "sub/b.txt": 5}
    sha = {f.path: f.sha256 for f in manifest.files}
    assert sha["a.bin"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert "modelship" in manifest.tool_versions
    assert manifest.created_at
    assert [p.name for p in artifact.parent.iterdir() if p.name.startswith(".tmp")] == []


def test_failed_writer_leaves_nothing(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    artifact = storage.base_dir("m")
    with (
        pytest.raises(RuntimeError),
        storage.lock(artifact),
        storage.publish(artifact, kind="t", source="s", revision=None, inputs_hash="x") as staging,
    ):
        (staging / "half.bin").write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert not artifact.exists()
    assert not artifact.parent.exists()  # nor its lock file, nor the model folder made for it


def test_a_waiter_behind_a_failed_first_writer_takes_a_fresh_lock(tmp_path: Path) -> None:
    """The failed writer removes the lock file the waiter is blocked on; the waiter must not
    hold that removed file's lock while a third writer locks a new file at the same path."""
    storage = Storage(tmp_path)
    artifact = storage.base_dir("m")
    lock_path = artifact.with_name(".base.lock")
    first_holds, waiter_holds = threading.Event(), threading.Event()

    def waiter() -> None:
        first_holds.wait()
        with storage.lock(artifact):
            waiter_holds.set()
            time.sleep(0.2)
            with storage.publish(
                artifact, kind="t", source="s", revision=None, inputs_hash="x"
            ) as staging:
                (staging / "w.bin").write_bytes(b"w")

    thread = threading.Thread(target=waiter)
    thread.start()
    with pytest.raises(RuntimeError), storage.lock(artifact):
        first_holds.set()
        time.sleep(0.3)  # the waiter blocks on this lock meanwhile
        raise RuntimeError("first writer failed")
    assert waiter_holds.wait(30)
    # A third writer must wait for the waiter: a non-blocking try on the path's file fails.
    with open(lock_path, "a") as handle, pytest.raises(BlockingIOError):
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    thread.join(30)
    assert (artifact / "w.bin").read_bytes() == b"w"


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from modelship.storage import Storage
    storage = Storage(sys.argv[1])
    artifact = storage.base_dir("m")
    with storage.lock(artifact):
        with storage.publish(artifact, kind="t", source="s", revision=None,
                             inputs_hash="x") as staging:
            (staging / "big.bin").write_bytes(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)
    """
)


def test_killed_writer_leaves_nothing_visible_and_next_run_succeeds(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    artifact = storage.base_dir("m")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(timeout=30)
    assert not artifact.exists()
    with pytest.raises(ArtifactNotFoundError):
        read_manifest(artifact)

    publish_files(storage, artifact, {"ok.bin": b"ok"})
    assert [f.path for f in verify_artifact(artifact, full=True).files] == ["ok.bin"]
    leftovers = [p.name for p in artifact.parent.iterdir() if p.name.startswith(".tmp")]
    assert leftovers == [], "the next writer must remove the dead writer's staging folder"


def test_corruption_is_detected_and_names_the_file(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    artifact = storage.base_dir("m")
    publish_files(storage, artifact, {"w.bin": b"0123456789", "c.json": b"{}"})

    (artifact / "w.bin").write_bytes(b"0123456780")  # same size, different bytes
    verify_artifact(artifact)  # the fast mode checks sizes only
    with pytest.raises(ChecksumMismatchError, match=r"w\.bin.*sha256"):
        verify_artifact(artifact, full=True)

    (artifact / "w.bin").write_bytes(b"short")
    with pytest.raises(ChecksumMismatchError, match=r"w\.bin.*size 5"):
        verify_artifact(artifact)

    (artifact / "c.json").unlink()
    with pytest.raises(ChecksumMismatchError, match=r"c\.json.*missing"):
        verify_artifact(artifact)


def test_a_damaged_artifact_is_not_memoized(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Memoization asks `intact_artifact`: a truncated file or a hand-edited manifest makes
    the stage redo the artifact (found by the storage drill: a damaged variant used to be
    memoized and then failed select), and the warning names the file."""
    storage = Storage(tmp_path)
    artifact = storage.variant_dir("m", "fp16")
    assert intact_artifact(artifact) is None  # nothing published: no warning either
    publish_files(storage, artifact, {"w.bin": b"0123456789"})
    assert intact_artifact(artifact) is not None

    (artifact / "w.bin").write_bytes(b"01234")
    assert intact_artifact(artifact) is None
    assert "w.bin: size 5 bytes" in caplog.text

    publish_files(storage, artifact, {"w.bin": b"0123456789"})
    (artifact / "manifest.json").write_text("{ edited by hand")
    assert intact_artifact(artifact) is None
    assert "manifest.json: not a valid manifest" in caplog.text


LOCKED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from modelship.storage import Storage
    storage = Storage(sys.argv[1])
    artifact = storage.base_dir("m")
    log = sys.argv[2]
    with storage.lock(artifact):
        with open(log, "a") as f:
            f.write(f"enter {os.getpid()}\\n")
        with storage.publish(artifact, kind="t", source="s", revision=None,
                             inputs_hash=str(os.getpid())) as staging:
            (staging / "pid").write_text(str(os.getpid()))
            time.sleep(0.3)
        with open(log, "a") as f:
            f.write(f"exit {os.getpid()}\\n")
    """
)


def test_concurrent_writers_are_serialized(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    log = tmp_path / "log.txt"
    writers = [
        subprocess.Popen([sys.executable, "-c", LOCKED_WRITER, str(tmp_path), str(log)])
        for _ in range(3)
    ]
    assert [w.wait(timeout=60) for w in writers] == [0, 0, 0]
    events = log.read_text().split()
    pairs = list(zip(events[0::2], events[1::2], strict=True))
    # Every "enter" is followed by the same writer's "exit": no two writers overlapped.
    for (enter, pid_in), (exit_, pid_out) in zip(pairs[0::2], pairs[1::2], strict=True):
        assert (enter, exit_, pid_in) == ("enter", "exit", pid_out)
    artifact = storage.base_dir("m")
    manifest = verify_artifact(artifact, full=True)
    assert (artifact / "pid").read_text() == manifest.inputs_hash


def test_production_pointer_switches_atomically(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    for number in (1, 2):
        publish_files(storage, storage.release_dir("m", number), {"v": str(number).encode()})
    storage.set_production("m", 1)
    assert storage.production_release("m") == 1
    storage.set_production("m", 2)
    link = storage.production_link("m")
    assert link.is_symlink() and (link / "v").read_text() == "2"
    assert storage.releases("m") == [1, 2]
    with pytest.raises(ArtifactNotFoundError):
        storage.set_production("m", 3)
    assert storage.production_release("m") == 2


def test_slugify() -> None:
    assert slugify("HuggingFaceTB/SmolLM2-135M-Instruct") == "huggingfacetb--smollm2-135m-instruct"
    assert slugify("My Model (v2)") == "my-model-v2"


CRASH_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, signal, sys
    from modelship.storage import Storage
    storage = Storage(sys.argv[1])
    artifact = storage.base_dir("m")
    real_rename = os.rename

    def rename_then_die(src, dst):
        real_rename(src, dst)
        if str(src) == str(artifact):  # the old artifact moved aside, the new one not in yet
            os.kill(os.getpid(), signal.SIGKILL)

    os.rename = rename_then_die
    with storage.lock(artifact):
        with storage.publish(artifact, kind="t", source="s", revision=None,
                             inputs_hash="v2") as staging:
            (staging / "v").write_text("2")
    """
)


def test_writer_killed_between_the_renames_keeps_the_old_artifact(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    artifact = storage.base_dir("m")
    publish_files(storage, artifact, {"v": b"1"})
    writer = subprocess.run([sys.executable, "-c", CRASH_BETWEEN_RENAMES, str(tmp_path)])
    assert writer.returncode == -signal.SIGKILL
    assert not artifact.exists()  # the crash state: only `.old-base-*` and `.tmp-base-*`
    names = sorted(p.name for p in artifact.parent.iterdir())
    assert [n[:9] for n in names if n.startswith(".old-")] == [".old-base"]
    assert [n[:9] for n in names if n.startswith(".tmp-")] == [".tmp-base"]

    with storage.lock(artifact):  # the next writer recovers before it writes
        assert (artifact / "v").read_text() == "1"
        verify_artifact(artifact, full=True)
    assert sorted(p.name for p in artifact.parent.iterdir()) == [".base.lock", "base"]

    publish_files(storage, artifact, {"v": b"3"})
    assert (artifact / "v").read_text() == "3"
    assert sorted(p.name for p in artifact.parent.iterdir()) == [".base.lock", "base"]


def test_recovery_leaves_a_sibling_with_a_longer_name_alone(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    artifact = storage.variant_dir("m", "int8")
    sibling = storage.variant_dir("m", "int8-x")
    publish_files(storage, artifact, {"v": b"1"})
    publish_files(storage, sibling, {"v": b"1"})
    # A writer of `int8-x` in the middle of replacing it (it holds int8-x's lock, not ours).
    sibling_old = sibling.with_name(".old-int8-x-0123abcd")
    sibling_staging = sibling.with_name(f".tmp-int8-x-{os.getpid()}-89abcdef")
    os.rename(sibling, sibling_old)
    sibling_staging.mkdir()

    publish_files(storage, artifact, {"v": b"2"})
    assert sibling_old.is_dir() and sibling_staging.is_dir()
    assert not sibling.exists(), "int8's writer must not restore int8-x's old folder"
    assert (artifact / "v").read_text() == "2"

    with storage.lock(sibling):  # int8-x's own next writer recovers it
        assert (sibling / "v").read_text() == "1"
    assert not sibling_old.exists() and not sibling_staging.exists()
