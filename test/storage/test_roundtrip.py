"""Byte-exact round trips through both backends, buffered and O_DIRECT, small and pipelined."""
import numpy as np
import pytest

from histate.storage import CheckpointStore, Fault, StoreConfig, aligned_empty, nixl_available

from storage_helpers import files_under

DTYPES = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_, np.complex64]
SHAPES = [(), (0,), (1,), (3, 5, 7), (4097,), (1000003,), (2, 3, 65536)]
# tiny chunks/pieces force the multi-piece pipeline (bounce slots, in-flight window) on small arrays
PIPELINES = {"default": {}, "tiny-pieces": dict(chunk_bytes=4096, piece_bytes=3 * 4096, max_inflight=3)}


def _random_array(rng, dtype, shape):
    if np.dtype(dtype).kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if np.dtype(dtype).kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_random_arrays_round_trip_byte_exact(make_store, direct_io, pipeline):
    store = make_store(direct_io=direct_io, **PIPELINES[pipeline])
    rng = np.random.default_rng(5)
    arrays = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            arrays[f"ckpt/{i}/{j}"] = _random_array(rng, dtype, shape)
    results = store.submit_put(list(arrays.items())).wait()
    assert [r.fault for r in results] == [None] * len(arrays)
    got = store.submit_get(list(arrays)).wait()
    for (key, a), r in zip(arrays.items(), got):
        assert r.hit, (key, r.fault)
        b = r.array()
        assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), key
    assert store.stats_snapshot()["hits"] == len(arrays)


@pytest.mark.parametrize("offset", [0, 1, 8, 4096 + 16])
def test_unaligned_sources_and_destinations(make_store, offset):
    """O_DIRECT needs aligned memory: unaligned caller buffers must go through bounce buffers."""
    store = make_store(direct_io=True, chunk_bytes=8192, piece_bytes=16384, max_inflight=2)
    rng = np.random.default_rng(offset)
    nbytes = 100_000 + offset
    backing = rng.integers(0, 256, nbytes + offset, dtype=np.uint8)
    src = backing[offset:]
    assert store.put("k", src).stored
    out_backing = np.zeros(nbytes + offset, dtype=np.uint8)
    out = out_backing[offset:]
    r = store.get("k", out=out)
    assert r.hit and r.buffer is not None and np.array_equal(out, src)
    assert not out_backing[:offset].any()  # nothing written outside the destination


def test_aligned_destination_is_filled_in_place(make_store):
    store = make_store()
    a = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    store.put("k", a)
    out = aligned_empty(a.nbytes)
    r = store.get("k", out=out)
    assert r.hit and np.shares_memory(r.buffer, out) and out.tobytes() == a.tobytes()
    # another size is a miss, not an error: a concurrent put may have replaced the key with it
    assert store.get("k", out=np.empty(a.nbytes + 1, np.uint8)).fault is Fault.SIZE_MISMATCH
    with pytest.raises(ValueError, match="writable"):  # what can never be a destination stays loud
        store.get("k", out=np.frombuffer(bytes(a.nbytes), np.uint8))


def test_kv_page_batch_round_trip(make_store):
    store = make_store()
    rng = np.random.default_rng(2)
    pages = [(f"kv/{i:03d}", rng.integers(0, 256, 256 << 10, dtype=np.uint8)) for i in range(64)]
    assert all(r.stored for r in store.submit_put(pages).wait())
    batch = store.submit_get([k for k, _ in pages] + ["kv/absent"])
    got = batch.wait()
    assert batch.poll()
    assert [r.key for r in got] == [k for k, _ in pages] + ["kv/absent"]
    assert all(np.array_equal(r.buffer, p) for r, (_, p) in zip(got[:-1], pages))
    assert got[-1].fault is Fault.NOT_FOUND


def test_torch_tensors_round_trip_including_bfloat16(make_store):
    torch = pytest.importorskip("torch")
    store = make_store()
    g = torch.Generator().manual_seed(0)
    t32 = torch.randn(3, 1000, generator=g)
    tbf = torch.randn(7, 333, generator=g).to(torch.bfloat16)
    assert store.put("f32", t32).stored and store.put("bf16", tbf).stored
    r = store.get("f32")
    assert r.array().dtype == np.float32 and torch.equal(torch.from_numpy(r.array()), t32)
    assert torch.equal(r.tensor(), t32)
    r = store.get("bf16")
    assert r.dtype_name == "torch.bfloat16" and r.shape == (7, 333) and r.array().dtype == np.uint8
    assert r.tensor().dtype == torch.bfloat16 and torch.equal(r.tensor(), tbf)
    out = torch.empty_like(tbf)
    assert store.get("bf16", out=out).hit and torch.equal(out, tbf)


def test_overwrite_replaces_and_accounts_bytes_once(make_store):
    store = make_store()
    store.put("k", np.zeros(10_000, np.uint8))
    used = store.used_bytes
    store.put("k", np.ones(10_000, np.uint8))
    assert store.used_bytes == used and store.get("k").array().min() == 1


def test_same_format_across_backends(tmp_path, backend):
    """Written by one backend, read by the other (and by both with and without O_DIRECT); objects and a pack."""
    if not nixl_available():
        pytest.skip("nixl not importable or its POSIX backend cannot start here")
    other = "file" if backend == "nixl" else "nixl"
    rng = np.random.default_rng(3)
    arrays = {f"x{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([1, 5000, 3_000_000])}
    pages = {f"kv/{i}": rng.integers(0, 256, 70_000 + i, dtype=np.uint8) for i in range(5)}
    cfg = dict(dirs=[str(tmp_path / "s")], capacity_bytes=1 << 30)
    with CheckpointStore(StoreConfig(backend=backend, direct_io=True, **cfg)) as s:
        assert all(r.stored for r in s.submit_put(list(arrays.items())).wait())
        assert all(r.stored for r in s.put_many(list(pages.items()), pack=True))
    arrays.update(pages)
    for direct in (True, False):
        with CheckpointStore(StoreConfig(backend=other, direct_io=direct, **cfg)) as s:
            assert s.backend_name == other
            for k, a in arrays.items():
                assert s.get(k).array().tobytes() == a.tobytes()


def test_files_are_whole_blocks_and_no_temp_files_remain(make_store, tmp_path):
    store = make_store(direct_io=False)
    for i, n in enumerate([1, 4095, 4096, 4097, 1 << 20]):
        store.put(f"k{i}", np.ones(n, np.uint8))
    files = [f for f in files_under(tmp_path / "store") if f.endswith(".hs")]
    assert len(files) == 5
    import os
    assert all(os.path.getsize(f) % 4096 == 0 for f in files)
    assert sum(os.path.getsize(f) for f in files) == store.used_bytes
    assert not [f for f in files_under(tmp_path / "store") if ".tmp-" in f]


@pytest.mark.parametrize("checksum", ["crc32", "xxh3"])
def test_either_checksum_round_trips_and_is_readable_by_default_config(make_store, tmp_path, checksum):
    if checksum == "xxh3":
        pytest.importorskip("xxhash")
    a = np.random.default_rng(8).standard_normal(700_000).astype(np.float32)
    with CheckpointStore(StoreConfig(dirs=[str(tmp_path / "c")], capacity_bytes=1 << 30, checksum=checksum,
                                     chunk_bytes=65536, piece_bytes=262144)) as s:
        assert s.put("k", a).stored
    store = make_store(dirs=[str(tmp_path / "c")])  # reads follow the algorithm each file names
    assert store.get("k").array().tobytes() == a.tobytes()
