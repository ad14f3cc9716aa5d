"""PQCache as the paper runs it (issue 14, item 2): k-means on host keys in a per-instance CPU worker
pool, the adaptive schedule as the default of the paper's protocol and fitted on the k-means it
governs, scikit-learn's k-means rules, and block-cache blocks counted from the sink."""

import json
import threading
from types import SimpleNamespace

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.kv.block_cache import BlockCache
from kvbench.kv.store import KVStore
from kvbench.methods import create_method, pqcache_workers
from kvbench.methods.pqcache_workers import KMeansWorkers
from kvbench.methods.primitives.kmeans import SKLEARN, initial_rows
from kvbench.methods.primitives.pq import pq_fit

BUDGET = BudgetConfig(token_ratio=0.2, comm_ratio=1 / 64)  # tiny_llama: m, b = 2, 4; 2 KV heads -> 4 problems


def spy_kmeans(monkeypatch):
    """Record (thread, problems, device) of every k-means share the workers run."""
    calls = []
    original = pqcache_workers.kmeans

    def recording(x, k, **kwargs):
        calls.append((threading.current_thread(), x.shape[0], x.device.type, kwargs))
        return original(x, k, **kwargs)

    monkeypatch.setattr(pqcache_workers, "kmeans", recording)
    return calls


def spy_pool(method):
    """The executor ``method`` opens at ``start`` (captured before ``release`` drops it)."""
    pools = []
    original = method.start

    def start(ctx):
        original(ctx)
        pools.append(method.workers._pool)

    method.start = start
    return pools


# ---------------------------------------------------------------------- the pool


def test_each_instance_has_its_own_pool_of_its_workers_and_it_shuts_down(tiny_llama, random_ids, monkeypatch):
    calls = spy_kmeans(monkeypatch)
    ids = random_ids(500, seed=61)
    one = create_method({"name": "pqcache", "protocol": "pqcache_niah", "workers": 1})
    three = create_method({"name": "pqcache", "protocol": "pqcache_niah", "workers": 3})
    pools = {}
    for method in (one, three):
        captured = spy_pool(method)
        calls.clear()
        generate(tiny_llama, method, ids, max_new_tokens=3, budget=BUDGET)
        pools[method.params.workers] = captured[0]
        layers = tiny_llama.spec.n_layers
        # every layer's 4 problems (2 KV heads x 2 sub-spaces) split into min(workers, 4) shares
        shares = min(method.params.workers, 4)
        assert len(calls) == layers * shares
        assert sum(problems for _, problems, _, _ in calls) == layers * 4
        # ... clustered on the pool's threads, never on the caller's
        assert all(
            thread is not threading.main_thread() and thread.name.startswith("kvbench-kmeans")
            for thread, _, _, _ in calls
        )
        assert len({thread for thread, _, _, _ in calls}) <= method.params.workers
    assert pools[1] is not pools[3]
    assert (pools[1]._max_workers, pools[3]._max_workers) == (1, 3)  # a class-level pool kept the first's 1
    for pool in pools.values():  # release shut each down and joined its threads
        assert pool._shutdown and not any(thread.is_alive() for thread in pool._threads)
    assert one.workers.closed and three.workers.closed
    with pytest.raises(RuntimeError, match="shut down"):
        one.workers.submit(torch.zeros(1, 8, 4), 1, 1, iters=1, metric="l2", seed=0, init="random", options={})


def test_a_new_request_reopens_the_pool(tiny_llama, random_ids):
    method = create_method({"name": "pqcache", "protocol": "pqcache_niah", "workers": 2})
    pools = spy_pool(method)
    first = generate(tiny_llama, method, random_ids(400, seed=62), max_new_tokens=3, budget=BUDGET)
    second = generate(tiny_llama, method, random_ids(400, seed=62), max_new_tokens=3, budget=BUDGET)
    assert pools[0] is not pools[1] and all(pool._shutdown for pool in pools)
    assert first.tokens == second.tokens


def test_a_failed_request_and_teacher_forcing_close_the_pool(tiny_llama, random_ids, monkeypatch):
    """The pool closes after every request, not only answered generations: a generation that raises
    mid-decode (its queued shares would otherwise run on into the next request) and teacher forcing
    (PG19), which has no answer to finish."""
    from kvbench.engine.generate import teacher_force

    ids = random_ids(400, seed=64)
    method = create_method({"name": "pqcache", "protocol": "pqcache_niah", "workers": 2})
    pools = spy_pool(method)
    teacher_force(tiny_llama, method, ids[:300], ids[300:320], budget=BUDGET)
    original = method.select

    def failing(*args):
        raise RuntimeError("boom")

    method.select = failing
    with pytest.raises(RuntimeError, match="boom"):
        generate(tiny_llama, method, ids, max_new_tokens=3, budget=BUDGET)
    method.select = original
    assert len(pools) == 2 and all(pool._shutdown for pool in pools)
    assert not any(thread.is_alive() for pool in pools for thread in pool._threads)


def test_splitting_a_layer_among_workers_gives_the_unsplit_codebook():
    """Shares use the shared random initial points, so 1 or 3 workers give pq_fit's codebook."""
    keys = torch.randn(2, 300, 16, generator=torch.Generator().manual_seed(0))
    reference = pq_fit(keys, 4, 3, iters=25, seed=4321, **SKLEARN)
    for workers in (1, 3, 8):
        pool = KMeansWorkers(workers)
        book, seconds = pool.submit(
            keys, 4, 3, iters=25, metric="l2", seed=4321, init="random", options=dict(SKLEARN)
        ).result()
        pool.shutdown()
        assert torch.equal(book.codes, reference.codes)
        assert torch.allclose(book.centroids, reference.centroids, atol=1e-5)
        assert book.iterations == reference.iterations and seconds > 0


# ---------------------------------------------------------------------- the schedule


def test_adaptive_is_the_protocol_default_and_fitted_on_the_cpu_workers(tiny_llama, random_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    method = create_method({"name": "pqcache", "workers": 2})
    assert (method.params.protocol, method.params.kmeans_iters, method.params.kmeans_device) == ("pqcache", None, "cpu")
    submits = []
    original = KMeansWorkers.submit

    def recording(self, keys, *args, **kwargs):
        submits.append((self, keys.device.type, kwargs["options"]))
        return original(self, keys, *args, **kwargs)

    monkeypatch.setattr(KMeansWorkers, "submit", recording)
    out = generate(tiny_llama, method, random_ids(600, seed=63), max_new_tokens=3, budget=BUDGET)
    tele = out.telemetry["method"]
    assert (tele["protocol"], tele["kmeans_schedule"], tele["kmeans_device"], tele["kmeans_workers"]) == (
        "pqcache",
        "adaptive",
        "cpu",
        2,
    )
    assert 3 <= tele["kmeans_iters"] <= 300
    # the cost model timed this instance's own pool, on host keys, at exact iteration counts
    timed = [s for s in submits if s[2] == {}]
    run = [s for s in submits if s[2] == SKLEARN]
    assert timed and len(run) == tiny_llama.spec.n_layers
    assert {id(s[0]) for s in timed} == {id(s[0]) for s in run} == {id(method.workers)}
    assert {s[1] for s in timed} == {"cpu"}
    files = list((tmp_path / "cost_models").glob("*.json"))
    model = f"tiny_llama-{tiny_llama.spec.device.replace(':', '')}-{tiny_llama.spec.dtype}"  # (cpu-float32 on a CPU)
    assert [f.name for f in files] == [f"{model}-m2b4-kmeans-cpu-w2-t{torch.get_num_threads()}-l2.json"]
    fitted = json.loads(files[0].read_text())
    assert fitted["kmeans"] == {"device": "cpu", "workers": 2, "threads": torch.get_num_threads(), "metric": "l2"}
    assert tele["cost_model"]["kmeans"] == fitted["kmeans"]


@pytest.mark.parametrize(
    ("cfg", "iters"),
    [
        ({"protocol": "pqcache_niah"}, 10),
        ({"kmeans_iters": 7}, 7),
        ({"protocol": "pqcache_niah", "kmeans_iters": 4}, 4),
    ],
)
def test_a_fixed_schedule_fits_no_cost_model(tiny_llama, random_ids, tmp_path, monkeypatch, cfg, iters):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    out = generate(
        tiny_llama, create_method({"name": "pqcache", **cfg}), random_ids(400, seed=64), max_new_tokens=3, budget=BUDGET
    )
    tele = out.telemetry["method"]
    assert tele["kmeans_schedule"] == tele["kmeans_iters"] == iters and tele["cost_model"] is None
    assert 0 < tele["kmeans_updates"] <= iters
    assert not (tmp_path / "cost_models").exists()


# ---------------------------------------------------------------------- the k-means rules


def one_empty_cluster_case(seed: int, n: int = 64) -> torch.Tensor:
    """1-D points ``[1, n, 1]``: the first two initial points (shared random rows for ``seed``) are both
    0, so the second cluster is empty after the first assignment (ties go to the lower index); the
    third and fourth start at 6 and 7, and one more point sits at 5, the point farthest from its
    centroid. Kept empty, the cluster stays empty ({0}, {}, {5, 6}, {7}); relocated, it takes 5."""
    rows = initial_rows(torch.zeros(1, n, 1), 4, init="random", seed=seed)[0].tolist()
    x = torch.zeros(1, n, 1)
    x[0, rows[2]], x[0, rows[3]] = 6.0, 7.0
    x[0, next(i for i in range(n) if i not in rows)] = 5.0
    return x


def pqcache_codes(cfg: dict, keys: torch.Tensor) -> torch.Tensor:
    """Codes from PQCache's own k-means settings (what ``on_prefill`` submits), m = 1, b = 2."""
    method = create_method({"name": "pqcache", **cfg})
    options = dict(SKLEARN) if method.params.kmeans_rules == "sklearn" else {}
    pool = KMeansWorkers(method.params.workers)
    book, _ = pool.submit(
        keys,
        1,
        2,
        iters=20,
        metric=method.params.metric,
        seed=method.params.seed,
        init=method.params.init,
        options=options,
    ).result()
    pool.shutdown()
    return book.codes[0, :, 0].long()


def test_pqcache_relocates_an_empty_cluster_by_default_and_clusterkv_keeps_it(tiny_llama, random_ids, monkeypatch):
    assert create_method({"name": "pqcache"}).params.kmeans_rules == "sklearn"
    keys = one_empty_cluster_case(seed=4321)  # PQCache's seed
    assert torch.bincount(pqcache_codes({}, keys), minlength=4).tolist() == [61, 1, 1, 1]
    assert torch.bincount(pqcache_codes({"kmeans_rules": "fixed"}, keys), minlength=4).tolist() == [61, 0, 2, 1]
    # the run passes the rules to every share
    calls = spy_kmeans(monkeypatch)
    generate(
        tiny_llama,
        create_method({"name": "pqcache", "protocol": "pqcache_niah"}),
        random_ids(300, seed=65),
        max_new_tokens=2,
        budget=BUDGET,
    )
    assert calls and all({k: kw[k] for k in SKLEARN} == SKLEARN for _, _, _, kw in calls)
    # ClusterKV keeps its own rules: an empty cluster keeps its centroid
    clusterkv = create_method({"name": "clusterkv", "metric": "l2"})
    clusterkv.iterations = []
    labels, centroids = clusterkv._cluster(one_empty_cluster_case(seed=clusterkv.params.seed)[0][None], 4)
    assert torch.bincount(labels[0], minlength=4).tolist() == [61, 0, 2, 1]
    assert centroids[0, 1].item() == 0.0  # where it started


# ---------------------------------------------------------------------- the block cache


def test_cache_blocks_start_at_the_sink():
    """A selection of the 128 slots after the 32 sinks is one block (the reference's grid); counted
    from slot 0 it would straddle two, and a one-block admission would serve only 96 of them."""
    method = create_method({"name": "pqcache", "protocol": "pqcache_niah", "cache_tokens": 256, "cache_blocks": 1})
    spec = SimpleNamespace(head_dim=16, n_kv_heads=2, device="cpu")
    store = KVStore(1, 2, 16, dtype=torch.float32, device=torch.device("cpu"), offload=True, capacity=400)
    ctx = SimpleNamespace(budget=SimpleNamespace(sink=32, local=64, comm_ratio=1 / 64), store=store, spec=spec)
    method.start(ctx)
    method.release()
    layer = store.layers[0]
    assert layer.cache.offset == 32
    assert layer.cache.block_of(torch.tensor([32, 159, 160, 287])).tolist() == [0, 0, 1, 1]
    layer.append(torch.randn(2, 400, 16), torch.randn(2, 400, 16))
    selected = torch.arange(32, 160).expand(2, -1)
    layer.gather(selected)
    assert (layer.stats.cache_lookups, layer.stats.cache_hits) == (256, 0)
    layer.gather(selected)
    assert (layer.stats.cache_lookups, layer.stats.cache_hits) == (512, 256)  # the one admitted block holds them all
    shifted = BlockCache(2, block_size=128, update_blocks=1, offset=0)
    shifted.update(shifted.block_of(selected[0]))
    assert int(shifted.lookup(shifted.block_of(selected[0])).sum()) == 96


# ---------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("device", "where"), [("cpu", "cpu"), ("model", "cuda")])
def test_on_cuda_kmeans_runs_where_asked(random_ids, monkeypatch, device, where):
    from kvbench.models.loading import load_model

    from .conftest import model_config

    loaded = load_model(model_config("tiny_llama", device="cuda", dtype="float32"))
    calls = spy_kmeans(monkeypatch)
    ids = random_ids(600, seed=66)
    cfg = {"name": "pqcache", "protocol": "pqcache_niah", "kmeans_device": device}
    for offload in (True, False):  # the store's host tier, or a side-stream copy of the keys
        calls.clear()
        out = generate(loaded, create_method({**cfg, "offload": offload}), ids, max_new_tokens=4, budget=BUDGET)
        assert calls and {c[2] for c in calls} == {where}
        assert out.telemetry["method"]["kmeans_device"].startswith(where)
    full = generate(loaded, create_method({"name": "full"}), ids, max_new_tokens=8, min_new_tokens=8)
    cover = generate(
        loaded, create_method(cfg), ids, max_new_tokens=8, min_new_tokens=8, budget=BudgetConfig(tokens=608)
    )
    assert cover.tokens == full.tokens
