"""Peak memory of a prefill per method, measured in a fresh process each.

On CUDA the figure is ``torch.cuda.max_memory_allocated`` during the generation; on a CPU it is the
peak resident set size sampled every 5 ms while the prefill runs, minus the resident size just
before it (the model and the prompt are loaded first). Each method runs in its own process, so one
method's allocations cannot hide another's.
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvbench.bench import BenchOptions, BenchResult, benchmark

_PROBE = r"""
import json, sys, threading, time, torch
from kvbench.budget import BudgetConfig
from kvbench.compose import compose
from kvbench.engine.generate import generate
from kvbench.methods import create_method
from kvbench.models.loading import load_model
from kvbench.tasks import create_task

model, method, length, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
loaded = load_model(compose([f"model={model}"])["model"])
ids = next(iter(create_task({"name": "niah", "lengths": [length], "depths": [0.5]}).samples(loaded))).input_ids

def rss():
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0

cuda = loaded.spec.device.startswith("cuda")
before = torch.cuda.memory_allocated() if cuda else rss()
if cuda:
    torch.cuda.reset_peak_memory_stats()
peak = [before]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
sampler = None if cuda else threading.Thread(target=sample, daemon=True)
if sampler:
    sampler.start()
out = generate(loaded, create_method({"name": method}), ids, max_new_tokens=1, budget=BudgetConfig(**budget))
done.set()
if sampler:
    sampler.join()
high = torch.cuda.max_memory_allocated() if cuda else max(peak[0], rss())
print(json.dumps({"before": before, "peak": high, "prompt": len(ids), "ttft_s": out.telemetry["ttft_s"],
                  "kv_bytes": out.telemetry["kv_bytes_after_prefill"]}))
"""


@benchmark("prefill_memory")
def prefill_memory(options: BenchOptions) -> BenchResult:
    model, lengths, _ = options.e2e(
        "tiny_llama" if options.quick else "smollm2_135m", (1024 if options.quick else 8000,)
    )
    length = lengths[0]
    budget = {"token_ratio": 0.1}
    rows = []
    results = {}
    for method in ("full", "h2o", "snapkv"):
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, model, method, str(length), json.dumps({} if method == "full" else budget)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if out.returncode != 0:
            raise RuntimeError(f"prefill_memory probe for {method} failed: {out.stderr.strip().splitlines()[-1:]}")
        results[method] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["full"]["peak"] - results["full"]["before"]
    for method, r in results.items():
        extra = r["peak"] - r["before"]
        rows.append(
            {
                "model": model,
                "prompt": r["prompt"],
                "method": method,
                "prefill_peak_MiB": extra / 2**20,
                "process_peak_MiB": r["peak"] / 2**20,
                "vs_full": extra / base if base else None,
                "kv_after_prefill_MiB": r["kv_bytes"] / 2**20,
                "ttft_s": r["ttft_s"],
            }
        )
    notes = [
        "prefill_peak: peak memory during generate (1 token) above the memory just before it",
        "fresh process per method; CPU figures sample VmRSS every 5 ms, CUDA ones use max_memory_allocated",
        f"budget {budget} for the dropping methods",
    ]
    return BenchResult("prefill_memory", "peak prefill memory, H2O and SnapKV vs full", rows, notes)
