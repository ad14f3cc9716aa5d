"""CacheBlend's system side: pipelined chunk loading, tier throughput, the loading controller, dependent
requests and the RAG pipelines (MapReduce / MapRerank)."""

import dataclasses
import threading

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.engine.reuse import ReusePrefill
from kvbench.errors import ConfigError
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkReader, ChunkStore, StoreConfig, TensorFile, measure_tiers
from kvbench.methods import create_method
from kvbench.methods.cacheblend import Costs, LoadingController
from kvbench.profile import Profile
from kvbench.requests import FollowUp, GenerateRequest, MultiQueryRequest, Output, join_segments
from kvbench.runner import run_sample
from kvbench.tasks import create_task
from kvbench.tasks.rag_pipelines import aggregate, parse_rerank, rerank

from .test_rag import qa_dir  # noqa: F401 (fixture)
from .test_reuse import segmented


def blend(loaded, segments, store, n=4, **cfg):
    method = create_method({"name": "cacheblend", "miss": "precompute", **cfg})  # (chunks loaded, never missed)
    method.attach_store(store)
    return generate(
        loaded,
        method,
        join_segments(segments),
        max_new_tokens=n,
        min_new_tokens=n,
        segments=segments,
        budget=BudgetConfig(),
    )


# ---------------------------------------------------------------------- pipelined loading
class EventLog(list):
    """(what, layer, thread) in the order they happened: chunk-layer reads and finished layers.

    With ``hold_until_next_read`` set to the model's layer count, a finished layer does not log
    "computed" until a read of the next layer has begun on some thread (10 s at most): a pipelined
    loader's worker starts that read while the main thread is held, a serial loader cannot (it reads on
    the main thread), so the order the test checks does not depend on how a busy machine schedules the
    worker thread."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()
        self.hold_until_next_read = 0

    def add(self, event: tuple) -> None:
        with self.changed:
            self.append(event)
            self.changed.notify_all()

    def hold(self, index: int) -> None:
        if index + 1 < self.hold_until_next_read:
            with self.changed:
                self.changed.wait_for(lambda: ("read", index + 1) in {e[:2] for e in self}, timeout=10.0)


@pytest.fixture
def events(monkeypatch):
    log = EventLog()
    read, done = ChunkReader.layer, ReusePrefill.after_layer

    def layer(self, index, **kw):
        log.add(("read", index, threading.current_thread().name))
        return read(self, index, **kw)

    def after_layer(self, index):
        log.hold(index)
        log.add(("computed", index, threading.current_thread().name))
        return done(self, index)

    monkeypatch.setattr(ChunkReader, "layer", layer)
    monkeypatch.setattr(ReusePrefill, "after_layer", after_layer)
    return log


def test_pipelined_loading_reads_the_next_layer_while_this_one_computes(tiny_llama, random_ids, tmp_path, events):
    segments = segmented(random_ids, seed=21)
    store = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path), read_mbps=20.0))
    blend(tiny_llama, segments, store, n=1)  # precompute the chunk caches
    layers = tiny_llama.spec.n_layers

    runs = {}
    for pipeline in (True, False):
        store.config = dataclasses.replace(store.config, pipeline=pipeline)
        events.clear()
        events.hold_until_next_read = layers if pipeline else 0
        out = blend(tiny_llama, segments, store)
        runs[pipeline] = (out, list(events))

    (piped, log_on), (serial, log_off) = runs[True], runs[False]
    assert piped.tokens == serial.tokens
    first_read = {}
    for log, pipeline in ((log_on, True), (log_off, False)):
        reads = [(i, e) for i, e in enumerate(log) if e[0] == "read"]
        computed = {e[1]: i for i, e in enumerate(log) if e[0] == "computed"}
        assert {e[1] for _, e in reads} == set(range(1, layers))  # from the check layer on
        threads = {e[2] for _, e in reads}
        assert (threads == {"MainThread"}) != pipeline and all(t.startswith("kv-loader") for t in threads) == pipeline
        first_read[pipeline] = {e[1]: i for i, e in reversed(reads)}
        for layer in range(1, layers - 1):
            # pipelined: layer + 1 is being read before layer finishes computing; serial: only after
            assert (first_read[pipeline][layer + 1] < computed[layer]) == pipeline
    on, off = piped.telemetry["prefill"], serial.telemetry["prefill"]
    assert on["pipelined"] and not off["pipelined"]
    assert off["load_hidden_s"] == 0.0 and off["load_wait_s"] >= off["load_s"]
    assert on["load_hidden_s"] > 0 and on["load_wait_s"] < on["load_s"]
    assert on["load_hidden_s"] == pytest.approx(on["load_s"] - on["load_wait_s"])
    assert all(x > 0 for x in on["load_per_layer_s"][1:]) and on["load_per_layer_s"][0] == 0
    assert all(x > 0 for x in on["recompute_per_layer_s"]) and on["recompute_s"] == pytest.approx(
        sum(on["recompute_per_layer_s"]), rel=1e-3
    )


def test_a_prefill_from_ram_pipelined_or_not_is_the_same(tiny_qwen2, random_ids):
    segments = segmented(random_ids, seed=22)
    store = ChunkStore(StoreConfig(tier="ram"))
    first = blend(tiny_qwen2, segments, store, recompute_ratio=0.3)
    store.config = dataclasses.replace(store.config, pipeline=False)
    second = blend(tiny_qwen2, segments, store, recompute_ratio=0.3)
    assert first.tokens == second.tokens
    assert first.telemetry["prefill"]["recompute_per_layer"] == second.telemetry["prefill"]["recompute_per_layer"]
    # the store's configuration and figures come with every sample
    assert (
        first.telemetry["method"]["store"]["pipeline"] is True
        and second.telemetry["method"]["store"]["pipeline"] is False
    )
    assert second.telemetry["method"]["store"]["ram_hits"] == 8


def test_a_ram_store_promotes_entries_found_on_disk_before_serving_them(tmp_path):
    key = ChunkKey("m", (1, 2), "alone")
    entry = ChunkKV([torch.randn(2, 5, 4) for _ in range(3)], [torch.randn(2, 5, 4) for _ in range(3)], 1)
    ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path))).put(key, entry)
    ram = ChunkStore(StoreConfig(tier="ram", dir=str(tmp_path)))
    assert ram.contains(key) == "disk" and ram.promote(key) and ram.contains(key) == "ram"
    assert ram.stats["ram"].promoted == 1 and ram.stats["disk"].hits == 0 and ram.stats["disk"].bytes_loaded == 0
    got = ram.get(key)
    assert got.start == 1 and all(torch.equal(a, b) for a, b in zip(got.keys + got.values, entry.keys + entry.values))
    assert not ram.promote(key)  # already in RAM
    assert not ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path))).promote(key)
    assert not ChunkStore(StoreConfig(tier="ram", dir=str(tmp_path), disk_gb=0)).promote(key)  # no disk folder


def test_store_pipeline_must_be_a_boolean():
    with pytest.raises(ConfigError, match="store.pipeline"):
        StoreConfig(pipeline="yes")


# ---------------------------------------------------------------------- disk reads and tier throughput
def test_tensor_file_reads_what_safetensors_wrote(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {
        "k.0": torch.randn(2, 7, 4, generator=g),
        "v.0": torch.randn(3, 5, generator=g).half(),
        "k.10": torch.randn(2, 3, 8, generator=g).bfloat16(),
        "v.10": torch.arange(6.0).view(2, 3),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"start": "1", "layers": "11"})
    mine = TensorFile(path)
    with safe_open(str(path), framework="pt") as theirs:
        for name in tensors:
            got = mine.read(name)
            assert got.dtype == tensors[name].dtype and torch.equal(got, theirs.get_tensor(name))
    assert mine.metadata == {"start": "1", "layers": "11"}
    mine.close()


def test_measured_tier_throughput_respects_the_throttle(tmp_path):
    slow = measure_tiers(
        StoreConfig(dir=str(tmp_path), read_mbps=4.0), kv_heads=2, tokens=256, head_dim=32, layers=2, repeats=1
    )
    assert slow["disk"]["layer_bytes"] == 2 * 2 * 256 * 32 * 4
    assert 2.0 < slow["disk"]["mbps"] <= 4.0 * 1.02  # padded with sleep to 4 MB/s, never faster
    assert slow["disk"]["layer_s"] == pytest.approx(slow["disk"]["layer_bytes"] / (slow["disk"]["mbps"] * 1e6))
    assert slow["ram"]["mbps"] > slow["disk"]["mbps"]
    assert not list(tmp_path.rglob("*.safetensors"))  # the probe cleans up after itself


# ---------------------------------------------------------------------- loading controller
def costs(**disk):
    # c = 2.4 s / (1000 tokens x 24 layers) = 1e-4 s per token per layer
    return Costs(prefill_s=2.4, tokens=1000, n_layers=24, bytes_per_token_layer=1024, tier_mbps={"ram": 5000.0, **disk})


@pytest.mark.parametrize(
    "disk_mbps,ratio,tier",
    [
        (10.0, 1024 * 900 / 10e6 / 0.1, "ram"),  # disk load 92 ms/layer > 15 % recompute (15 ms): ratio rises, RAM
        (100.0, 0.15, "disk"),  # disk load 9.2 ms < 15 ms: r* holds and the disk adds no delay
        (1.0, 1.0, "ram"),  # disk slower than recomputing everything: capped at 1
    ],
)
def test_controller_picks_max_of_r_load_and_r_star_and_the_cheapest_tier_without_delay(disk_mbps, ratio, tier):
    choice = LoadingController(costs(disk=disk_mbps), r_star=0.15).choose(n=1000, n_cached=900, served_from="disk")
    assert choice["ratio"] == pytest.approx(ratio)
    assert choice["r_load"] == pytest.approx(1024 * 900 / (disk_mbps * 1e6) / 0.1)
    assert choice["tier"] == tier and choice["tier_adds_delay"] is False
    assert choice["load_layer_s"]["disk"] == pytest.approx(1024 * 900 / (disk_mbps * 1e6))
    assert choice["recompute_layer_s"]["r_star"] == pytest.approx(0.15 * 1000 * 1e-4)
    from_ram = LoadingController(costs(disk=disk_mbps), r_star=0.15).choose(n=1000, n_cached=900, served_from="ram")
    assert from_ram["ratio"] == 0.15


def test_controller_without_a_tier_that_keeps_up_takes_the_fastest():
    slow = Costs(
        prefill_s=0.024, tokens=1000, n_layers=24, bytes_per_token_layer=1024, tier_mbps={"ram": 50.0, "disk": 5.0}
    )
    choice = LoadingController(slow, r_star=0.15).choose(n=1000, n_cached=900, served_from="ram")
    assert choice["tier"] == "ram" and choice["tier_adds_delay"] is True


def test_controller_applies_its_ratio_and_matches_the_measured_load(tiny_llama, random_ids, tmp_path):
    segments = segmented(random_ids, seed=23)
    n, query = len(join_segments(segments)), len(segments[-1])
    store = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path), read_mbps=2.0))
    method = create_method({"name": "cacheblend", "controller": True, "miss": "precompute"})
    method.attach_store(store)

    def run():
        return generate(
            tiny_llama, method, join_segments(segments), max_new_tokens=2, segments=segments, budget=BudgetConfig()
        )

    out = run()
    choice = out.telemetry["prepared"]["controller"]
    c = choice["costs"]
    token_layer_s = c["prefill_s"] / (c["tokens"] * c["n_layers"])
    load = c["bytes_per_token_layer"] * (n - query) / (c["tier_mbps"]["disk"] * 1e6)
    assert choice["r_load"] == pytest.approx(load / (n * token_layer_s))
    assert choice["ratio"] == pytest.approx(min(1.0, max(choice["r_load"], 0.15)))
    assert c["tier_mbps"]["disk"] <= 2.0 * 1.02
    per_layer = out.telemetry["prefill"]["recompute_per_layer"]
    assert per_layer[2] == (int((n - query) * choice["ratio"]) + query) / n  # the chosen ratio was applied
    measured = out.telemetry["prefill"]["load_per_layer_s"][2:]
    assert min(measured) >= 0.9 * choice["load_layer_s"]["disk"] and max(measured) <= 3 * choice["load_layer_s"]["disk"]
    again = run()  # costs are measured once per run
    assert again.telemetry["prepared"]["controller"]["costs"] == c


def test_controller_cannot_follow_filter_ratios():
    with pytest.raises(ConfigError, match="filter_ratios"):
        create_method({"name": "cacheblend", "controller": True, "filter_ratios": [0.3, 0.15]})


# ---------------------------------------------------------------------- dependent requests
class Echo:
    """A task whose second request is built from the first one's output: its prompt plus the answer."""

    def requests(self, sample, model):
        first = GenerateRequest(input_ids=sample, max_new_tokens=3, min_new_tokens=3)

        def then(outputs):
            assert len(outputs) == 1
            more = sample + outputs[0].tokens
            inner = FollowUp(
                lambda outs: [GenerateRequest(input_ids=more[:5], max_new_tokens=1)] if len(outs) == 2 else []
            )
            return [GenerateRequest(input_ids=more, max_new_tokens=2, min_new_tokens=2), inner]

        return [first, FollowUp(then)]

    def result(self, sample, outputs):
        return outputs


def test_follow_up_requests_are_built_from_earlier_outputs_and_run_in_order(tiny_llama, random_ids):
    prompt = random_ids(20, seed=24)
    outputs = run_sample(Echo(), prompt, tiny_llama, create_method({"name": "full"}), BudgetConfig(), Profile())
    assert [o.prompt_tokens for o in outputs] == [20, 23, 5]
    direct = generate(
        tiny_llama, create_method({"name": "full"}), prompt + outputs[0].tokens, max_new_tokens=2, min_new_tokens=2
    )
    assert outputs[1].tokens == direct.tokens


# ---------------------------------------------------------------------- RAG pipelines
@pytest.mark.parametrize(
    "text,parsed",
    [
        ("Answer: Paris\nScore: 90", ("Paris", 90)),
        (" London \n  Score: 7 and more", ("London", 7)),
        ("the Analytical Engine\nScore: 100\nAnswer: x", ("the Analytical Engine", 100)),
        ("Paris", ("Paris", None)),
        ("Answer: Rome\nConfidence: high", ("Rome", None)),
        ("", ("", None)),
    ],
)
def test_map_rerank_outputs_parse_like_langchains_regex(text, parsed):
    assert parse_rerank(text) == parsed


def test_map_rerank_keeps_the_highest_score_ties_to_the_first_unparsed_last():
    outs = [Output(text=t) for t in ("a\nScore: 50", "b\nScore: 90", "c\nScore: 90", "no score")]
    assert rerank(outs)[0] == 1
    assert rerank([Output(text="x"), Output(text="y\nScore: 0")])[0] == 1
    assert rerank([Output(text="x"), Output(text="y")])[0] == 0


def _out(text, ttft, decode, prompt=10):
    return Output(
        text=text,
        tokens=[1],
        stop_reason="stop",
        prompt_tokens=prompt,
        telemetry={"ttft_s": ttft, "decode_s": decode, "tt2t_s": ttft + 0.01, "new_tokens": 2},
    )


def test_mapreduce_maps_every_chunk_then_reduces_the_summaries(tiny_llama, qa_dir):  # noqa: F811
    task = create_task(
        {"name": "rag", "dataset": "musique", "data_dir": str(qa_dir), "pipeline": "mapreduce", "limit": 1}
    )
    sample = next(iter(task.samples(tiny_llama)))
    chunks = [s for s in sample.segments if s.role == "chunk"]
    requests = task.requests(sample, tiny_llama)
    maps, follow = requests[:-1], requests[-1]
    assert len(maps) == len(chunks) == 6 and isinstance(follow, FollowUp)

    def encode(text):
        return tiny_llama.tokenizer(text, add_special_tokens=False).input_ids

    question = encode("where was Ada Lovelace born?")
    for request, chunk in zip(maps, chunks):
        assert request.segments[1] == chunk and request.max_new_tokens == 64
        assert _contains(request.input_ids, question)
    outs = [_out(f"summary {i}", 0.5, 0.25) for i in range(6)]
    (reduce,) = follow.build(outs)
    assert reduce.segments[-1] == sample.segments[-1]  # the dataset's own query prompt and question
    assert [s.role for s in reduce.segments] == ["prefix"] + ["chunk"] * 6 + ["query"]
    assert _contains(reduce.input_ids, encode("Summary 3: summary 2"))
    result = task.result(sample, outs + [_out("London", 0.4, 0.2)])
    assert result.score == pytest.approx(100.0) and result.prediction == "London"
    assert result.telemetry["ttft_s"] == pytest.approx(6 * 0.75 + 0.4)
    assert result.telemetry["pipeline"]["ttft_parallel_s"] == pytest.approx(0.75 + 0.4)
    assert result.meta["map_outputs"][2] == "summary 2"


def test_maprerank_answers_the_best_scored_chunk(tiny_llama, qa_dir):  # noqa: F811
    task = create_task(
        {"name": "rag", "dataset": "musique", "data_dir": str(qa_dir), "pipeline": "maprerank", "limit": 1}
    )
    sample = next(iter(task.samples(tiny_llama)))
    requests = task.requests(sample, tiny_llama)
    assert len(requests) == 6 and all(isinstance(r, GenerateRequest) and r.max_new_tokens == 32 for r in requests)
    texts = ["Paris\nScore: 20", "Answer: London\nScore: 95", "x", "Bath\nScore: 95", "y\nScore: 3", "z\nScore: 1"]
    result = task.result(sample, [_out(t, 0.5, 0.5) for t in texts])
    assert result.prediction == "London" and result.score == pytest.approx(100.0)
    assert result.meta["chosen"] == 1 and result.meta["unparsed"] == 1 and result.meta["map_scores"][2] is None
    assert result.telemetry["ttft_s"] == pytest.approx(6.0) and result.telemetry["pipeline"]["ttft_parallel_s"] == 1.0
    assert task.aggregate([result.to_record()])["rerank_scores_parsed"] == round(5 / 6, 4)


def test_a_cued_maprerank_feeds_the_score_cue_after_the_answer_and_ranks_by_it(tiny_llama, qa_dir):  # noqa: F811
    cfg = {"name": "rag", "dataset": "musique", "data_dir": str(qa_dir), "pipeline": "maprerank", "limit": 2}
    task = create_task({**cfg, "rerank_score": "cued", "map_tokens": 3})
    sample = list(task.samples(tiny_llama))[1]  # two passages
    requests = task.requests(sample, tiny_llama)
    assert all(isinstance(r, MultiQueryRequest) and r.keep_answers for r in requests) and len(requests) == 2
    free = create_task(cfg).requests(sample, tiny_llama)
    assert [r.context_ids + list(r.queries[0].ids) for r in requests] == [r.input_ids for r in free]
    assert tiny_llama.tokenizer.decode(list(requests[0].queries[1].ids)) == "\nScore:"
    turns = [(["Paris", "20"], 1.0), (["London", "95"], 2.0)]
    outs = [
        Output(
            text=a,
            telemetry={"prefill_s": s, "ttft_s": s},
            turns=[Output(text=a, telemetry={"turn_s": 0.5}), Output(text=b, telemetry={"turn_s": 0.25})],
        )
        for (a, b), s in turns
    ]
    result = task.result(sample, outs)
    assert result.meta["map_scores"] == [20, 95] and result.meta["chosen"] == 1 and result.meta["unparsed"] == 0
    assert result.prediction == "London" and result.meta["map_outputs"] == ["Paris\nScore: 20", "London\nScore: 95"]
    assert result.telemetry["ttft_s"] == pytest.approx(1.75 + 2.75)
    assert result.telemetry["pipeline"]["ttft_parallel_s"] == pytest.approx(2.75)
    ran = run_sample(task, sample, tiny_llama, create_method({"name": "full"}), BudgetConfig(), Profile())
    assert all("\nScore:" in text for text in ran.meta["map_outputs"]) and len(ran.meta["map_outputs"]) == 2
    with pytest.raises(ConfigError, match="rerank_score"):
        create_task({**cfg, "rerank_score": "forced"})


def test_a_maprerank_run_records_and_says_how_few_scores_parsed(capsys):
    def record(unparsed):
        return {"score": 0.0, "meta": {"map_outputs": ["a"] * 6, "unparsed": unparsed}}

    assert aggregate("maprerank", [record(1), record(0)]) == {"rerank_scores_parsed": round(11 / 12, 4)}
    assert "carried a score" not in capsys.readouterr().err
    assert aggregate("maprerank", [record(6), record(5)]) == {"rerank_scores_parsed": round(1 / 12, 4)}
    assert "only 1 of 12 map outputs carried a score line" in capsys.readouterr().err
    assert aggregate("mapreduce", [record(6)]) == {}


def test_a_pipeline_runs_end_to_end_on_the_engine(tiny_llama, qa_dir):  # noqa: F811
    task = create_task(
        {
            "name": "rag",
            "dataset": "musique",
            "data_dir": str(qa_dir),
            "pipeline": "mapreduce",
            "map_tokens": 3,
            "limit": 2,
        }
    )
    sample = list(task.samples(tiny_llama))[1]  # two passages
    result = run_sample(task, sample, tiny_llama, create_method({"name": "full"}), BudgetConfig(), Profile())
    steps = result.telemetry["pipeline"]["steps"]
    assert [s["step"] for s in steps] == ["map", "map", "reduce"] and all(s["new_tokens"] <= 3 for s in steps[:2])
    assert result.telemetry["ttft_s"] == pytest.approx(
        sum(s["ttft_s"] + s["decode_s"] for s in steps[:2]) + steps[2]["ttft_s"]
    )
    assert 0 <= result.score <= 100


@pytest.mark.parametrize(
    "cfg,needle",
    [
        ({"pipeline": "refine"}, "task.pipeline"),
        ({"pipeline": "mapreduce", "map_tokens": 0}, "task.map_tokens"),
        ({"pipeline": "maprerank", "dataset": "multi_news"}, "multi_news"),
    ],
)
def test_bad_pipeline_settings_are_refused(cfg, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        create_task({"name": "rag", "dataset": "musique", "data_dir": str(tmp_path), **cfg})


def _contains(ids, part):
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


# ---------------------------------------------------------------------- the benchmarks
def test_chunk_load_reuse_pipeline_and_recompute_cost_benchmarks_report_their_figures():
    from kvbench.bench import BenchOptions, discover

    benches = discover()
    options = BenchOptions(quick=True, repeats=1)
    tiers = benches["chunk_load"](options).rows
    assert [row["tier"] for row in tiers] == ["ram", "disk", "disk@1000MB/s", "disk@200MB/s", "disk@50MB/s"]
    assert all(row["MB/s"] > 0 and row["r_load"] > 0 for row in tiers)
    assert tiers[-1]["MB/s"] <= 50 * 1.02
    (row,) = benches["reuse_pipeline"](options).rows
    assert row["pipelined/serial"] == pytest.approx(row["ttft_pipelined_s"] / row["ttft_serial_s"])
    assert 0 <= row["load_hidden_s"] <= row["load_s"]
    costs = benches["recompute_cost"](options).rows
    dense = [r for r in costs if r["run"] == "dense"]
    assert [r["tokens"] for r in dense] == sorted(r["tokens"] for r in dense) and len(dense) == 3
    blend = {r["r"]: r for r in costs if r["run"] == "cacheblend"}
    assert set(blend) == {0.15, 0.5} and blend[0.15]["model_s"] < blend[0.5]["model_s"] < dense[-1]["ttft_s"]


def test_prefill_batch_times_the_computation_full_runs(tmp_path):
    """Fig. 15(c)'s batched dense prefill is `full`'s computation: every row of the batch generates
    what the engine's `full` generates for the prompt; the bench's rows say what they time, and its
    figure lands beside the saved record."""
    from kvbench.bench import BenchOptions, discover
    from kvbench.bench.chunk_load import _load, _segments, batched_dense
    from kvbench.engine.generate import generate
    from kvbench.methods import create_method
    from kvbench.requests import join_segments

    options = BenchOptions(quick=True, repeats=1)
    loaded = _load(options)
    ids = join_segments(_segments(loaded, True))
    reference = generate(loaded, create_method({"name": "full"}), ids, max_new_tokens=6)
    _, _, tokens = batched_dense(loaded, ids, 3, 5)
    assert tokens.shape == (3, 6)
    assert all(row == list(reference.tokens) for row in tokens.tolist())
    result = discover()["prefill_batch"](BenchOptions(quick=True, repeats=1, save=str(tmp_path / "b.json")))
    rows = result.rows
    figure = tmp_path / "b.prefill_batch.png"
    assert f"figure: {figure}" in result.notes and figure.read_bytes()[:4] == b"\x89PNG"
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["cacheblend_prefill_s"] == pytest.approx(r["batch"] * rows[0]["cacheblend_prefill_s"])
        assert r["prefill share"] == pytest.approx(r["full_prefill_s"] / (r["full_prefill_s"] + r["decode_s"]))
