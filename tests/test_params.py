"""Typed method parameters: one declaration gives Hydra's defaults, the checks and the help."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal, get_args

import pytest

from kvbench.compose import compose, method_sweep_points
from kvbench.errors import ConfigError
from kvbench.methods import PARAMS, REGISTRY, create_method, method_node, validate_method_config
from kvbench.params import Params, describe, help_rows, param, parse


@dataclass(frozen=True)
class Toy(Params):
    n: int = param(3, "a count", min=1)
    ratio: float = param(0.5, "a share", min=0, max=1)
    flag: bool = param(False, "a switch")
    mode: Literal["fast", "exact"] = param("exact", "a choice")
    iters: int | Literal["adaptive"] = param(10, "a number or a word", min=0)
    size: int | None = param(None, "optional", min=1)
    layers: tuple[int, ...] = param((0, 1), "a list", min=0)


def toy(**values):
    return parse(Toy, values, owner="toy", prefix="toy.")


def error_of(**values) -> str:
    with pytest.raises(ConfigError) as caught:
        toy(**values)
    return str(caught.value)


# ---------------------------------------------------------------------- the parsing layer
def test_defaults_and_conversions():
    assert toy() == Toy()
    got = toy(n=5.0, ratio=1, iters="adaptive", size=None, layers=[2, 3.0])
    assert (got.n, type(got.n)) == (5, int) and (got.ratio, type(got.ratio)) == (1.0, float)
    assert got.iters == "adaptive" and got.layers == (2, 3)
    assert toy(iters=7).iters == 7
    from omegaconf import OmegaConf

    assert parse(Toy, OmegaConf.create({"layers": [4, 5]}), owner="toy").layers == (4, 5)  # a Hydra node


def test_unknown_keys_name_the_valid_ones():
    message = error_of(bogus=1, nn=2)
    assert "toy has no parameters toy.bogus, toy.nn" in message
    assert "use one of: n, ratio, flag, mode, iters, size, layers" in message
    assert "did you mean" not in error_of(bogus=1)
    assert "did you mean toy.iters?" in error_of(itres=1)


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"n": "abc"}, "toy.n=abc is not an integer (toy)"),
        ({"n": 5.5}, "toy.n=5.5 is not an integer"),
        ({"n": True}, "toy.n=true is not an integer"),
        ({"flag": 1}, "toy.flag=1 is not true or false"),
        ({"flag": "yes"}, "toy.flag=yes is not true or false"),
        ({"ratio": "half"}, "toy.ratio=half is not a number"),
        ({"mode": "quick"}, "toy.mode=quick is not one of 'fast', 'exact'"),
        ({"iters": "fast"}, "toy.iters=fast is not an integer or 'adaptive'"),
        ({"iters": 2.5}, "toy.iters=2.5 is not an integer or 'adaptive'"),
        ({"size": "big"}, "toy.size=big is not an integer or null"),
        ({"layers": "0,1"}, "toy.layers=0,1 is not a list of integers"),
        ({"layers": [0, "x"]}, "is not a list of integers"),
    ],
)
def test_wrong_types_name_key_value_type_and_an_example(values, needle):
    message = error_of(**values)
    assert needle in message and "(fix: give " in message and ", e.g. toy." in message


def test_examples_are_valid_values():
    for key, value in (("n", "abc"), ("mode", 3), ("size", "big"), ("layers", "x"), ("iters", "fast")):
        example = error_of(**{key: value}).split(f"e.g. toy.{key}=")[1].rstrip(")")
        assert example in {"3", "exact", "1", "[0,1]", "10"}, (key, example)


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"n": 0}, "toy.n=0 is out of range"),
        ({"ratio": 1.5}, "use a value in [0, 1]"),
        ({"size": 0}, "use a value >= 1"),
        ({"layers": [0, -1]}, "toy.layers=-1 is out of range"),
    ],
)
def test_ranges(values, needle):
    assert needle in error_of(**values)


def test_describe_round_trips_every_method():
    for name, cls in PARAMS.items():
        default = cls()
        assert parse(cls, describe(default), owner=name) == default
    changed = dataclasses.replace(PARAMS["quest"](), dense_layers=(2, 5), page_size=32)
    plain = describe(changed)
    assert plain["dense_layers"] == [2, 5] and parse(PARAMS["quest"], plain, owner="quest") == changed


def test_help_rows():
    rows = {row[0]: row for row in help_rows(Toy)}
    assert rows["iters"] == ("iters", "int | adaptive", "10", "a number or a word")
    assert rows["size"][1:3] == ("int | null", "null") and rows["layers"][1:3] == ("list[int]", "[0,1]")
    assert rows["mode"][1] == "fast | exact" and rows["flag"][2] == "false"


# ---------------------------------------------------------------------- the methods' declarations
def test_every_shipped_method_declares_its_params():
    shipped = {n for n in REGISTRY.names() if REGISTRY.get(n).__module__.startswith("kvbench.methods.")}
    assert shipped == set(PARAMS)
    for name, cls in PARAMS.items():
        real = REGISTRY.get(name).Params  # the class its module defines when imported (torch and all)
        assert real.__module__ in (REGISTRY.get(name).__module__, "kvbench.params"), name  # one file a method
        assert _declared(real) == _declared(cls), name  # what kvbench.declarations read from the source
        assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(cls)), name
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), name
        assert describe(create_method({"name": name}).params) == describe(cls())


def _declared(cls):
    """A Params class's declaration: per field its type, default and metadata (help, range, legacy)."""
    hints = __import__("typing").get_type_hints(cls)
    return [(f.name, str(hints[f.name]), f.default, dict(f.metadata)) for f in dataclasses.fields(cls)]


def test_hydra_nodes_are_the_dataclass_defaults():
    """One source of truth: what ``method=<name>`` composes is the declaration's defaults."""
    for name, cls in PARAMS.items():
        node = compose([f"method={name}"])["method"]
        assert node == method_node(name) == {"name": name, **describe(cls())}
        assert validate_method_config(node) == cls()


def test_the_shared_groups_in_config_yaml_are_their_declarations():
    """``budget``, ``profile``, ``store`` and ``engine`` are declared once (Params); conf/config.yaml's nodes
    hold the same defaults, and leave out only the keys added later so that they name no run."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.settings import EngineSettings
    from kvbench.kv.chunks import StoreConfig
    from kvbench.profile import Profile

    composed = compose([])
    unrecorded = {"profile": {"selection_digest"}, "store": {"pipeline"}, "engine": set(), "budget": set()}
    groups = {"profile": Profile, "store": StoreConfig, "engine": EngineSettings, "budget": BudgetConfig}
    for group, cls in groups.items():
        declared = describe(cls())
        assert set(declared) - set(composed[group]) == unrecorded[group], group
        assert composed[group] == {key: declared[key] for key in composed[group]}, group
    assert parse(StoreConfig, {"tier": "disk", "ram_gb": 1}, "store", "store.") == StoreConfig("disk", 1.0)
    for group, cls, bad in [("profile", Profile, {"recall_rule": "sum"}), ("store", StoreConfig, {"ram_gb": -1})]:
        with pytest.raises(ConfigError, match=f"{group}\\.{next(iter(bad))}"):
            parse(cls, bad, group, f"{group}.")


def test_overrides_reach_the_method():
    node = compose(
        ["method=pqcache", "method.m=2", "method.b=4", "method.kmeans_iters=adaptive", "method.dense_layers=[0,3]"]
    )["method"]
    method = create_method(node)
    assert (method.params.m, method.params.b, method.params.kmeans_iters) == (2, 4, "adaptive")
    assert method.dense_layers == (0, 3)
    assert method.describe() == {"family": "retrieval", **node}


def test_choices_match_the_primitives():
    from kvbench.methods.attention_scores import GQA_REDUCTIONS, MAX_CHUNK_ELEMENTS, POOLINGS
    from kvbench.methods.primitives.kmeans import INITS, METRICS
    from kvbench.methods.primitives.pq import GQA_RULES
    from kvbench.methods.pyramidkv import ROUNDINGS

    hints = {name: __import__("typing").get_type_hints(cls) for name, cls in PARAMS.items()}
    assert get_args(hints["h2o"]["gqa"]) == GQA_REDUCTIONS == get_args(hints["snapkv"]["gqa"])
    assert get_args(hints["snapkv"]["pooling"]) == POOLINGS
    assert get_args(hints["pqcache"]["gqa"]) == GQA_RULES == get_args(hints["oracle"]["gqa"])
    assert get_args(hints["pyramidkv"]["rounding"]) == ROUNDINGS
    for name in ("pqcache", "clusterkv"):
        assert set(get_args(hints[name]["metric"])) == set(METRICS)
        assert set(get_args(hints[name]["init"])) <= set(INITS)
    assert PARAMS["h2o"]().chunk_elements == MAX_CHUNK_ELEMENTS


def test_method_rules():
    with pytest.raises(ConfigError, match="method.m=5 without method.b"):
        validate_method_config({"name": "pqcache", "m": 5})
    with pytest.raises(ConfigError, match="method.b=6 without method.m"):
        create_method({"name": "pqcache", "b": 6})
    with pytest.raises(ConfigError, match="kernel must be odd"):
        create_method({"name": "snapkv", "kernel": 4})
    with pytest.raises(ConfigError, match="beta must be positive"):
        create_method({"name": "pyramidkv", "beta": 0})
    with pytest.raises(ConfigError, match="method full has no parameter method.sink"):
        create_method({"name": "full", "sink": 4})
    with pytest.raises(ConfigError, match="method snapkv has no parameter method.local_fraction"):
        create_method({"name": "snapkv", "local_fraction": 0.2})


def test_budget_defaults_come_from_the_params():
    assert create_method({"name": "quest"}).defaults().sink == 0  # Quest keeps no sinks (16 was ClusterKV's setting)
    assert create_method({"name": "quest", "sink": 8, "local_fraction": 0.25}).defaults().local_fraction == 0.25
    assert create_method({"name": "streamingllm"}).defaults().compensable
    assert not create_method({"name": "pqcache"}).defaults().compensable


# ---------------------------------------------------------------------- sweeps and the command line
def test_every_sweep_point_is_expanded():
    points = method_sweep_points(["method=pqcache,oracle", "method.m=2,4", "+method.b=6", "task.lengths=[1,2]"])
    assert [(p["name"], p["m"], p["b"]) for p in points] == [
        ("pqcache", 2, 6),
        ("pqcache", 4, 6),
        ("oracle", 2, 6),
        ("oracle", 4, 6),
    ]
    assert points[2]["gqa"] == "softmax_sum" and points[2]["offload"] is False
    default = method_sweep_points(["method.sink=8"])
    assert default == [{"name": "full", "sink": 8}]  # the config's default method
    restored = method_sweep_points(["method=quest", "~method.page_size", "method.sink=${oc.env:SINK}"])
    assert restored == [{k: v for k, v in method_node("quest").items() if k != "page_size"}]
    # malformed overrides and flags are Hydra's to report; the rest is still checked
    assert method_sweep_points(["method=pqcache", "method.m=[1,", "--cfg", "method.b=4"]) == [
        {**method_node("pqcache"), "b": 4}
    ]


KVBENCH_IN_PROCESS = (
    "import sys, time; t = time.perf_counter(); import kvbench.cli as c; rc = c.main(sys.argv[1:]);"
    "print(rc, 'torch' in sys.modules, round(time.perf_counter() - t, 2))"
)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["method=pqcache", "method.bogus=1"], "method pqcache has no parameter method.bogus"),
        (["method=pqcache", "+method.bogus=1"], "method pqcache has no parameter method.bogus"),
        (["method=pqcache", "method.m=abc"], "method.m=abc is not an integer or null"),
        (["method=pqcache", "method.kmeans_iters=foo"], "method.kmeans_iters=foo is not an integer or 'adaptive'"),
        (["-m", "method=pqcache", "method.m=2,abc", "method.b=6"], "method.m=abc"),  # the second point
        (["-m", "method=pqcache,oracle", "method.m=2", "method.b=6"], "method oracle has no parameters"),
        # the rules between groups, checked on the typed config without torch (kvbench.validate.CROSS_CHECKS)
        (["method=h2o", "budget.tokens=null"], "method h2o compresses the KV cache and needs a budget"),
        (["method=cacheblend", "task=niah"], "task niah's prompts are not split into chunks"),
        (["method=quest", "method.dense_layers=[0,99]"], "so there is no layer 99"),
        (["method=h2o", "task=niah", "task.lengths=[128]", "budget.tokens=100", "budget.sink=32"], "covers the"),
    ],
)
def test_cli_rejects_bad_method_keys_and_cross_group_rules_before_loading_anything(tmp_path, args, needle):
    out_dir = tmp_path / "runs"
    started = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            KVBENCH_IN_PROCESS,
            "run",
            "model=tiny_llama",
            f"output_dir={out_dir}",
            *([] if any(arg.startswith("budget.tokens") for arg in args) else ["budget.tokens=64"]),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - started
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: ") and needle in lines[0], result.stderr
    assert "fix:" in lines[0]
    rc, torch_loaded, _ = result.stdout.split()
    assert rc == "2" and torch_loaded == "False"  # nothing heavy was imported, let alone a model
    assert elapsed < 3, elapsed
    assert not out_dir.exists()


def test_unknown_key_lists_the_valid_keys():
    with pytest.raises(ConfigError) as caught:
        validate_method_config({"name": "pqcache", "bogus": 1})
    fields = [f.name for f in dataclasses.fields(PARAMS["pqcache"])]
    assert caught.value.fix == f"use one of: {', '.join(fields)}"


def test_list_methods_shows_parameters(capsys):
    from kvbench.cli import main

    assert main(["list", "methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "pqcache (retrieval)" in lines and "full (dense): no parameters" in lines
    row = next(line for line in lines if line.split()[:1] == ["kmeans_iters"] and "adaptive" in line)
    assert row.split()[1:7] == ["int", "|", "adaptive", "|", "null", "null"]  # null: method.protocol's
    assert sum(line.startswith(tuple(f"{name} (" for name in PARAMS)) for line in lines) == len(PARAMS)


def test_a_method_preset_is_its_method_with_the_values_set(tmp_path):
    """``method=pqcache_niah`` composes to PQCache with ``protocol=pqcache_niah`` (the same node, so the same
    run id, as ``method=pqcache method.protocol=pqcache_niah``), can be swept beside other methods, and is
    listed among the choices of an unknown-method error."""
    from kvbench.compose import compose_many
    from kvbench.methods import METHOD_PRESETS, method_choices, method_node
    from kvbench.results import run_id_for

    assert "pqcache_niah" in method_choices() and set(METHOD_PRESETS) <= set(method_choices())
    preset, explicit = compose_many(
        [
            ["method=pqcache_niah", "model=tiny_llama", "task=niah", "budget.token_ratio=0.1"],
            [
                "method=pqcache",
                "method.protocol=pqcache_niah",
                "model=tiny_llama",
                "task=niah",
                "budget.token_ratio=0.1",
            ],
        ]
    )
    assert preset["method"] == explicit["method"] == method_node("pqcache_niah")
    assert preset["method"]["name"] == "pqcache" and preset["method"]["protocol"] == "pqcache_niah"
    assert run_id_for(preset) == run_id_for(explicit)
    with pytest.raises(ConfigError) as error:
        method_node("pqcache_nah")
    assert "pqcache_niah" in error.value.fix


def test_a_methods_typed_group_read_without_torch_matches_the_built_method():
    """``MethodConfig.parse`` reads a shipped method's family from its declaration (no torch); what the
    cross-group checks take from it (a budget is needed, a chunk store is read) is what the class says."""
    from kvbench.config import MethodConfig

    for name in PARAMS:
        node = method_node(name)
        light, built = MethodConfig.parse(node), MethodConfig.parse(node, create_method(node))
        assert (light.name, light.family, light.needs_budget, light.uses_chunk_store) == (
            built.name,
            built.family,
            built.needs_budget,
            built.uses_chunk_store,
        ), name
        assert describe(light.params) == describe(built.params), name
