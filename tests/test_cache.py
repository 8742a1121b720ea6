"""The decode-once cache: content keys, hits without decoding, rebuilds of stale or damaged
entries, atomic writes, memory-mapped read-only storage, and the >= 10x speed-up on real PACS."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock
from PIL import Image

from feddomain.data import cache, sources
from feddomain.data.cache import CacheEntry, CacheWriter, content_key
from feddomain.data.sources import load_dataset
from feddomain.errors import DataError

FILES = [("a/x/0.png", 100, 1_000), ("a/x/1.png", 120, 2_000), ("b/x/0.png", 90, 3_000)]


def key_of(files, name="folder", resolution=8, classes=("x",)):
    return content_key(name, resolution, ("a", "b"), classes, files)


def test_key_is_stable_and_changes_with_any_file_or_setting():
    base = key_of(FILES)
    assert base == key_of(list(FILES)) and len(base) == 64
    variants = [
        [*FILES, ("b/x/1.png", 80, 4_000)],  # one image added
        FILES[:-1],  # one removed
        [FILES[0], ("a/x/1.png", 121, 2_000), FILES[2]],  # one replaced: new size
        [FILES[0], ("a/x/1.png", 120, 2_001), FILES[2]],  # one replaced: new mtime
        [FILES[0], ("a/x/2.png", 120, 2_000), FILES[2]],  # one renamed
    ]
    keys = {base, *(key_of(v) for v in variants)}
    keys |= {key_of(FILES, name="PACS"), key_of(FILES, resolution=9), key_of(FILES, classes=("y",))}
    assert len(keys) == 9


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "c"))
    assert cache.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(cache.ENV_VAR)
    assert cache.default_cache_dir() == Path.home() / ".cache" / "feddomain"


# --------------------------------------------------------------------------- loader + cache


def make_folder(base: Path, n_per_class: int = 3) -> None:
    for d, domain in enumerate(("a", "b")):
        for c, cls in enumerate(("x", "y")):
            (base / domain / cls).mkdir(parents=True, exist_ok=True)
            for k in range(n_per_class):
                colour = (100 * d + 5, 100 * c + 5, 40 * k + 5)
                Image.new("RGB", (10, 10), colour).save(base / domain / cls / f"{k}.png")


class DecodeCounter:
    """Wraps the loader's decode step to count how many images it decodes."""

    def __init__(self, monkeypatch):
        self.images = 0
        real = sources._decode_images

        def counting(index, resolution, sink):
            self.images += len(index)
            return real(index, resolution, sink)

        monkeypatch.setattr(sources, "_decode_images", counting)


def forbid_decoding(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("a cache hit must not decode any image")

    monkeypatch.setattr(sources, "_decode_images", fail)


@pytest.fixture()
def folder(tmp_path):
    make_folder(tmp_path / "data")
    return tmp_path / "data"


def cache_files(cache_dir: Path) -> list[str]:
    """The suffixes of the entries' files (not the empty lock file the build leaves)."""
    return sorted(p.suffix for p in cache_dir.iterdir() if p.suffix != ".lock")


def test_second_load_is_a_hit_that_decodes_nothing(folder, tmp_path, monkeypatch):
    first = load_dataset("folder", folder, 5, tmp_path / "cache")
    assert cache_files(tmp_path / "cache") == [".json", ".u8"]
    forbid_decoding(monkeypatch)
    second = load_dataset("folder", folder, 5, tmp_path / "cache")
    assert torch.equal(first.images, second.images) and first.paths == second.paths
    assert torch.equal(first.labels, second.labels)
    assert torch.equal(first.domain_ids, second.domain_ids)


def test_env_var_sets_the_default_cache_folder(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "from-env"))
    load_dataset("folder", folder, 4)
    assert cache_files(tmp_path / "from-env") == [".json", ".u8"]


@pytest.mark.parametrize("change", ["add", "remove", "replace"])
def test_changing_one_image_rebuilds_the_entry(folder, tmp_path, monkeypatch, change):
    load_dataset("folder", folder, 4, tmp_path / "cache")
    target = folder / "b" / "y" / "1.png"
    if change == "add":
        Image.new("RGB", (10, 10), (1, 2, 3)).save(folder / "b" / "y" / "9.png")
    elif change == "remove":
        target.unlink()
    else:
        Image.new("RGB", (10, 10), (1, 2, 3)).save(target)
        os.utime(target, ns=(1, 7))  # a replacement whose mtime differs even on coarse clocks
    counter = DecodeCounter(monkeypatch)
    ds = load_dataset("folder", folder, 4, tmp_path / "cache")
    assert counter.images == {"add": 13, "remove": 11, "replace": 12}[change]
    assert cache_files(tmp_path / "cache") == [".json", ".u8"]  # replaced, not piled up
    if change != "remove":
        row = ds.paths.index("b/y/9.png" if change == "add" else "b/y/1.png")
        assert ds.images[row, :, 0, 0].tolist() == [1, 2, 3]


def test_truncated_image_file_is_rebuilt_with_a_warning(folder, tmp_path, monkeypatch, caplog):
    # A copy: the first load maps the very file this test damages in place (the cache itself
    # never writes in place; it replaces files, so live mappings keep their pixels).
    expected = load_dataset("folder", folder, 4, tmp_path / "cache").images.clone()
    (u8,) = (tmp_path / "cache").glob("*.u8")
    full = u8.stat().st_size
    os.truncate(u8, full - 5)
    counter = DecodeCounter(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="feddomain.data.cache"):
        again = load_dataset("folder", folder, 4, tmp_path / "cache")
    assert counter.images == 12
    assert str(u8) in caplog.text and f"has {full - 5} bytes, expected {full}" in caplog.text
    assert torch.equal(expected, again.images) and u8.stat().st_size == full


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda m: m.update(key="0" * 64), "is stale"),
        (lambda m: m.update(shape=[11, 3, 4, 4], nbytes=11 * 48), "does not match its metadata"),
        (lambda m: m.pop("skipped"), "malformed metadata"),
        (lambda m: m.update(dtype="float32"), "does not match its metadata"),
    ],
)
def test_mismatched_metadata_is_never_trusted(folder, tmp_path, monkeypatch, caplog, edit, says):
    first = load_dataset("folder", folder, 4, tmp_path / "cache")
    (meta_path,) = (tmp_path / "cache").glob("*.json")
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    counter = DecodeCounter(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="feddomain.data.cache"):
        again = load_dataset("folder", folder, 4, tmp_path / "cache")
    assert counter.images == 12 and says in caplog.text
    assert torch.equal(first.images, again.images)


def test_unparsable_metadata_is_rebuilt(folder, tmp_path, monkeypatch, caplog):
    load_dataset("folder", folder, 4, tmp_path / "cache")
    (meta_path,) = (tmp_path / "cache").glob("*.json")
    meta_path.write_text('{"key": "abc"')  # cut short
    counter = DecodeCounter(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="feddomain.data.cache"):
        load_dataset("folder", folder, 4, tmp_path / "cache")
    assert counter.images == 12 and f"cache metadata {meta_path} is unreadable" in caplog.text


def test_images_are_mapped_copy_on_write_from_the_cache_file(folder, tmp_path):
    ds = load_dataset("folder", folder, 4, tmp_path / "cache")
    (u8,) = (tmp_path / "cache").glob("*.u8")
    on_disk = u8.read_bytes()
    assert on_disk == ds.images.numpy().tobytes()
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: the tensor's memory is a mapping of the cache file, not a copy
        ptr = ds.images.data_ptr()
        spans = [
            line.split()[0].split("-")
            for line in maps.read_text().splitlines()
            if line.endswith(str(u8.resolve()))
        ]
        assert any(int(lo, 16) <= ptr < int(hi, 16) for lo, hi in spans)
    half = ds.images[:6].float() / 255  # later code can convert slices
    assert half.dtype == torch.float32 and half.shape == (6, 3, 4, 4)
    ds.images[0] += 1  # private to this process: the file is opened read-only
    assert u8.read_bytes() == on_disk
    fresh = load_dataset("folder", folder, 4, tmp_path / "cache")
    assert fresh.images.numpy().tobytes() == on_disk


def test_writer_without_commit_leaves_nothing_behind(tmp_path):
    entry = CacheEntry.locate(tmp_path, "folder", 2, tmp_path)
    with pytest.raises(RuntimeError), CacheWriter(entry, (3, 2, 2)) as writer:
        writer.append(np.zeros((4, 3, 2, 2), dtype=np.uint8))
        raise RuntimeError("decoding failed half-way")
    assert list(tmp_path.iterdir()) == []


def test_writer_publishes_rows_in_order_and_read_checks_the_row_count(tmp_path):
    entry = CacheEntry.locate(tmp_path, "folder", 2, tmp_path)
    rows = np.arange(5 * 12, dtype=np.uint8).reshape(5, 3, 2, 2)
    with CacheWriter(entry, (3, 2, 2)) as writer:
        writer.append(rows[:2])
        writer.append(rows[2:])
        writer.commit("k", n_sources=6, skipped={"a/x/bad.png": "OSError: truncated"})
    hit = cache.read(entry, "k", 6, (3, 2, 2))
    assert np.array_equal(hit.images.numpy(), rows)
    assert hit.skipped == {"a/x/bad.png": "OSError: truncated"}
    assert cache.read(entry, "other key", 6, (3, 2, 2)) is None
    assert cache.read(entry, "k", 7, (3, 2, 2)) is None  # 7 files, 1 skipped: 6 rows expected
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.meta.name, entry.images.name]


def test_a_process_that_waited_for_another_build_reads_it_instead_of_building(tmp_path):
    """Catches parallel workers rebuilding one stale entry at once (issue 26's campaign: the
    second's commit removed the first's metadata while the first read it back, "could not be
    read back after writing", and the run failed). Another holder of the entry's lock builds
    it while this call waits: this call must not build and must return the other's rows."""
    entry = CacheEntry.locate(tmp_path / "cache", "folder", 2, tmp_path)
    rows = np.arange(4 * 12, dtype=np.uint8).reshape(4, 3, 2, 2)
    holding, built = threading.Event(), []

    def other_process() -> None:
        with FileLock(entry.lock):  # a second lock object: it excludes this one's like a process
            holding.set()
            time.sleep(0.3)
            with CacheWriter(entry, (3, 2, 2)) as writer:
                writer.append(rows)
                writer.commit("k", n_sources=4, skipped={})

    other = threading.Thread(target=other_process)
    other.start()
    holding.wait()
    hit = cache.read_or_build(entry, "k", 4, (3, 2, 2), lambda writer: built.append(1) or {})
    other.join()
    assert built == []
    assert np.array_equal(hit.images.numpy(), rows)


def test_unwritable_cache_folder_is_a_data_error_naming_it(folder, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(DataError, match=f"cannot write the image cache at {blocker}"):
        load_dataset("folder", folder, 4, blocker / "cache")


# --------------------------------------------------------------------------- real PACS


@pytest.fixture(scope="session")
def pacs_cold_load(shared_data, cache_dir, tmp_path_factory):
    """First load of PACS at 32 px into a cache without it, timed.

    Uses the session's shared cache_dir when another module has not filled it yet (so PACS is
    still decoded once per session); otherwise a fresh folder, since a cold load is the point.
    """
    entry = CacheEntry.locate(cache_dir, "PACS", 32, shared_data / "PACS")
    target = cache_dir if not entry.meta.exists() else tmp_path_factory.mktemp("pacs-cold")
    start = time.perf_counter()
    ds = load_dataset("PACS", shared_data, 32, target)
    return target, time.perf_counter() - start, ds


def test_second_pacs_load_is_ten_times_faster_and_decodes_nothing(
    pacs_cold_load, shared_data, monkeypatch
):
    target, cold_seconds, cold = pacs_cold_load
    forbid_decoding(monkeypatch)
    warm_seconds = float("inf")
    for _ in range(3):  # the fastest of three: a warm load is repeatable, the noise is not
        start = time.perf_counter()
        warm = load_dataset("PACS", shared_data, 32, target)
        warm_seconds = min(warm_seconds, time.perf_counter() - start)
    assert torch.equal(warm.images, cold.images) and warm.paths == cold.paths
    assert cold_seconds / warm_seconds >= 10, (cold_seconds, warm_seconds)
