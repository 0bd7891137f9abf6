"""Packed batches: one file per batch of pages, each page still addressable, deletable and verified alone."""
import os

import numpy as np
import pytest

from histate.storage import CheckpointStore, Fault, StoreConfig

from storage_helpers import files_under

PAGE = 16 << 10


def _pages(n, seed=0, size=PAGE, prefix="kv"):
    rng = np.random.default_rng(seed)
    return [(f"{prefix}/{i:03d}", rng.integers(0, 256, size, dtype=np.uint8)) for i in range(n)]


def _store_files(root):
    return [p for p in files_under(root) if p.endswith((".hs", ".hsp"))]


def _books_exact(store):
    on_disk = sum(os.path.getsize(p) for root in store.layout.roots for p in _store_files(root))
    assert store.used_bytes == on_disk <= store.config.capacity_bytes


PIPELINES = {"default": {}, "tiny-pieces": dict(chunk_bytes=4096, piece_bytes=3 * 4096, max_inflight=3)}


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_a_batch_is_one_file_and_every_page_is_addressable(make_store, pipeline):
    store = make_store(**PIPELINES[pipeline])
    pages = _pages(64)
    pages[7] = ("kv/007", np.arange(PAGE // 4, dtype=np.float32).reshape(64, -1))  # typed pages keep dtype/shape
    results = store.submit_put(pages, pack=True).wait()
    assert all(r.stored for r in results)
    files = _store_files(store.layout.roots[0])
    assert len(files) == 1 and files[0].endswith(".hsp")
    assert sum(r.file_bytes for r in results) == os.path.getsize(files[0])
    for key, page in [pages[0], pages[7], pages[63]]:  # one page alone
        r = store.get(key)
        assert r.hit and r.array().dtype == page.dtype and r.array().shape == page.shape
        assert r.array().tobytes() == page.tobytes()
    outs = [np.empty(p.nbytes + 1, np.uint8)[1:] for _, p in pages]  # unaligned: bounce buffers
    got = store.submit_get([k for k, _ in pages] + ["kv/absent"], out=outs + [None]).wait()
    assert [r.hit for r in got] == [True] * 64 + [False]
    assert all(o.tobytes() == p.tobytes() for o, (_, p) in zip(outs, pages))
    _books_exact(store)


def test_deleting_one_page_persists_and_the_last_page_frees_the_file(make_store, tmp_path):
    dirs = [str(tmp_path / "s")]
    store = make_store(dirs=dirs)
    pages = dict(_pages(8))
    store.submit_put(list(pages.items()), pack=True).wait()
    assert store.delete("kv/003") is True and not store.exists("kv/003")
    assert store.get("kv/003").fault is Fault.NOT_FOUND
    _books_exact(store)
    store.close()
    store = make_store(dirs=dirs)
    assert sorted(store.keys()) == sorted(k for k in pages if k != "kv/003")
    for k in store.keys():
        assert store.get(k).array().tobytes() == pages[k].tobytes()
    for k in store.keys():
        store.delete(k)
    assert _store_files(dirs[0]) == [] and store.used_bytes == 0


def test_a_corrupt_page_is_a_miss_and_only_that_page_goes(make_store, tmp_path):
    dirs = [str(tmp_path / "s")]
    events = []
    store = make_store(dirs=dirs, on_evict=events.append)
    pages = dict(_pages(6))
    store.submit_put(list(pages.items()), pack=True).wait()
    entry = store._index.get("kv/002")
    with open(entry.path, "r+b") as fh:
        fh.seek(entry.offset + 100)
        fh.write(b"\xff\x00\xff")
    assert store.get("kv/002").fault is Fault.CORRUPT
    assert [(e.key, e.reason) for e in events] == [("kv/002", "fault")]
    assert all(store.get(k).hit for k in pages if k != "kv/002")
    store.close()
    store = make_store(dirs=dirs)
    assert sorted(store.keys()) == sorted(k for k in pages if k != "kv/002")


def test_capacity_eviction_takes_whole_packs(make_store, clock):
    events = []
    pack_bytes = 4096 + 4 * PAGE  # one header block + four pages
    store = make_store(capacity_bytes=3 * pack_bytes + 1000, on_evict=events.append, clock=clock)
    for batch in range(3):
        assert all(r.stored for r in store.submit_put(_pages(4, seed=batch, prefix=f"b{batch}"), pack=True).wait())
        clock.advance(1.0)
        _books_exact(store)
    store.submit_put(_pages(4, seed=9, prefix="b3"), pack=True).wait()  # needs room: the oldest pack goes
    evicted = sorted(e.key for e in events)
    assert evicted == [f"b0/{i:03d}" for i in range(4)] and {e.reason for e in events} == {"capacity"}
    assert not any(k.startswith("b0/") for k in store.keys())
    _books_exact(store)


def test_a_large_batch_is_split_at_pack_max_bytes(make_store):
    store = make_store(pack_max_bytes=5 * PAGE)
    assert all(r.stored for r in store.submit_put(_pages(12), pack=True).wait())
    assert len(_store_files(store.layout.roots[0])) == 3  # 5 + 5 + 2 pages
    assert all(store.get(f"kv/{i:03d}").hit for i in range(12))


def test_a_page_rewritten_alone_replaces_its_packed_copy_also_on_disk(make_store, tmp_path):
    dirs = [str(tmp_path / "s")]
    store = make_store(dirs=dirs)
    pages = dict(_pages(4))
    store.submit_put(list(pages.items()), pack=True).wait()
    fresh = np.full(PAGE, 9, np.uint8)
    assert store.put("kv/001", fresh).stored
    assert store.get("kv/001").array().tobytes() == fresh.tobytes()
    _books_exact(store)
    store.close()
    store = make_store(dirs=dirs)
    assert store.get("kv/001").array().tobytes() == fresh.tobytes()
    store.delete("kv/001")
    store.close()
    store = make_store(dirs=dirs)  # the packed copy does not come back once the newer one is deleted
    assert sorted(store.keys()) == ["kv/000", "kv/002", "kv/003"]


def test_a_batch_of_more_items_than_one_header_lists_is_split_by_count(make_store):
    """65,538 empty pages (two more than a header can list, format.MAX_ITEMS = 65,536): two packs, every
    page stored. (Before: one group, whose header failed to encode in the worker -- every put `io_error`.)"""
    store = make_store(max_write_backlog_items=1 << 20)
    empty = np.empty(0, np.uint8)
    results = store.put_many([(f"kv/{i}", empty) for i in range(65_538)], pack=True)
    assert [r.fault for r in results if not r.stored] == []
    assert [p[-4:] for p in _store_files(store.layout.roots[0])] == [".hsp", ".hsp"]
    assert [r.hit for r in store.get_many(["kv/0", "kv/65535", "kv/65536", "kv/65537"])] == [True] * 4
    _books_exact(store)


def test_a_damaged_pack_header_loses_the_pack_at_restart_and_nothing_else(make_store, tmp_path):
    """Documented limit (docs/storage.md, "Packs"): the header is the pack's only index, so a flipped
    byte in it drops every page of that pack at restart; other files are untouched. A redundant index
    was weighed and left out: it would protect 1 block of 4,097 in a 16 MiB pack, for a second header
    write per pack and two liveness writes per delete."""
    dirs = [str(tmp_path / "s")]
    store = make_store(dirs=dirs)
    doomed, kept = dict(_pages(8, seed=1, prefix="a")), dict(_pages(8, seed=2, prefix="b"))
    store.submit_put(list(doomed.items()), pack=True).wait()
    store.submit_put(list(kept.items()), pack=True).wait()
    path = store._index.get("a/000").path
    store.close()
    with open(path, "r+b") as fh:  # a byte of the first item's key, inside the CRC-checked header
        fh.seek(60)
        byte = fh.read(1)
        fh.seek(60)
        fh.write(bytes([byte[0] ^ 0x01]))
    store = make_store(dirs=dirs)
    assert store.rebuild_report.reasons == {"corrupt": 1} and not os.path.exists(path)
    assert sorted(store.keys()) == sorted(kept)
    assert all(store.get(k).array().tobytes() == v.tobytes() for k, v in kept.items())
