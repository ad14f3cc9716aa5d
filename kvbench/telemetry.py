"""Per-sample measurements: latency phases, attended tokens, recall of the exact top-k.

Definitions (shared by every method so that tables compare like with like):

* ``ttft_s`` — prompt in, first token out (the prefill and its logits).
* ``prefill_shared`` — the K/V came from a dense prefill shared by a sweep's methods
  (:mod:`kvbench.engine.prefill_cache`); ``ttft_s`` is then the dense prefill time measured when it
  was computed, plus the method's own prefill work (its statistics, indexing or eviction) measured on
  the shared K/V.
* ``tt2t_s`` — time to the 2nd token: TTFT plus the first decode step. PQCache's metric: work a
  method overlaps with prefill (K-means) and waits for at the first decode step lands here.
* ``tpot_s`` — mean time of the decode steps after the first (PQCache measures TPOT as
  ``(T(n) - TT2T) / (n - 2)``); ``tpot_p50_s`` / ``tpot_p90_s`` their percentiles.
* ``attended_per_layer`` — mean tokens attended per head at a decode step, per layer;
  ``kept_per_layer`` — tokens each layer holds right after prefill.
* ``recall`` — how much of the exact top-B a step attends (only with ``profile.recall=true``: it
  costs an exact scoring pass, excluded from the step times), averaged over query heads, then over
  the decode steps of every layer that selects (layers a method leaves dense, such as Quest's and
  ClusterKV's layers 0-1, have none), then over layers. The default rule,
  ``profile.recall_rule=attended``, is the ClusterKV paper's Fig. 11 quantity and is the same for
  every method:

  - **B** = ``sink + budget`` tokens: the prompt tokens a method attends at a decode step
    (``ResolvedBudget.total``; the layer's own budget under PyramidKV-style per-layer budgets);
    ``recall_b`` records it. With ``budget.tokens=T`` and ``budget.sink=S``, B = S + T whatever the
    method, so every method compared at the same ``budget.*`` keys is scored against the same B;
  - **exact set**, per query head: the B prompt tokens with the largest raw ``q·k`` over *all* prompt
    keys, sinks included (generated tokens excluded, as in ClusterKV's ``stat_topk``);
  - **predicted set**, per query head: the prompt tokens the step attends — sinks, local window and
    selected tokens alike; a per-KV-head selection gives every query head of the group the same set;
  - ``recall = |predicted ∩ exact| / B`` (``B`` capped at the held prompt).

  ``recall_rule=softmax_sum|logit_sum|max`` is the earlier rule (kept for old runs, not comparable
  across methods): the chosen part only, against the exact top-k of the candidates with k = the number
  chosen (see :mod:`kvbench.profile`).
* ``select_s`` / ``fetch_s`` / ``compute_s`` — the decode time split into the method's selection
  (index search, e.g. PQ scoring), the store's gather of the selected K/V (host→device fetch) and the
  rest (the model's layers and attention). Host-side clocks: on CUDA, asynchronous kernels are
  counted where they are waited for.
* ``selection_digest`` — with ``profile.selection_digest=true``: a 16-hex digest of the positions each
  layer holds after prefill and attends at each decode step (see :mod:`kvbench.profile`).
* ``bytes_h2d_index_per_step`` / ``bytes_h2d_kv_per_step`` — host→device bytes per decode step of the
  index data (PQ codes, key slices, block representatives) and of K/V (fetches and cache fills).

On CUDA the clock synchronises the device before reading ``perf_counter``; on CPU it reads it directly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


class Telemetry:
    """Collects one sample's figures while the engine runs."""

    def __init__(self, n_layers: int, clock: Clock) -> None:
        self.clock = clock
        self.n_layers = n_layers
        self.attended: list[list[float]] = [[] for _ in range(n_layers)]  # tokens per head, per step
        self.available: list[list[int]] = [[] for _ in range(n_layers)]
        self.recall: list[list[float]] = [[] for _ in range(n_layers)]
        self.recall_b: int | None = None  # B of the ``attended`` recall rule (the last layer's)
        self.kept_after_prefill: list[int] | None = None
        self.kv_bytes_after_prefill: int | None = None
        self.prefill_s: float | None = None
        self.prefill_shared = False  # the prefill's K/V came from a sweep's shared prefill (prefill_cache)
        self.step_s: list[float] = []
        self.excluded_s = 0.0  # profiling time inside a step, removed from its duration
        self.select_s = 0.0  # decode time in the method's select()
        self.fetch_s = 0.0  # decode time in the store's gather()
        self.prepared: dict[str, Any] = {}  # work before the clock (reuse: chunk precomputation)
        self.prefill_plan: dict[str, Any] = {}  # the prefill plan's own figures (reuse: recompute, loads)
        self._digest: Any = None  # hashlib state of the selection digest (profile.selection_digest)

    def digest_positions(self, tag: str, layer: int, positions: torch.Tensor) -> None:
        """Fold ``positions`` (``[rows, k]``, one row per head) into the selection digest, each row
        sorted so that only the *set* of positions a head holds or attends counts."""
        if self._digest is None:
            self._digest = hashlib.sha256()
        rows = positions.detach().to("cpu", torch.int64).sort(dim=-1).values
        self._digest.update(f"{tag}:{layer}:{tuple(rows.shape)};".encode())
        self._digest.update(rows.numpy().tobytes())

    def record_decode(self, layer: int, attended: float, available: int, recall: float | None = None) -> None:
        """``attended``: tokens per head (a mean over heads when a padded selection's rows differ)."""
        self.attended[layer].append(int(attended) if float(attended).is_integer() else float(attended))
        self.available[layer].append(int(available))
        if recall is not None:
            self.recall[layer].append(float(recall))

    def summary(self) -> dict[str, Any]:
        steps = self.step_s
        later = steps[1:]
        recall_layers = [_mean(r) for r in self.recall]
        recall_all = [value for layer in self.recall for value in layer]
        return {
            "ttft_s": self.prefill_s,
            "tt2t_s": (self.prefill_s + steps[0]) if (self.prefill_s is not None and steps) else None,
            "tpot_s": _mean(later),
            "tpot_p50_s": float(np.percentile(later, 50)) if later else None,
            "tpot_p90_s": float(np.percentile(later, 90)) if later else None,
            "prefill_s": self.prefill_s,
            "prefill_shared": self.prefill_shared,
            "decode_s": float(sum(steps)) if steps else 0.0,
            "select_s": self.select_s,
            "fetch_s": self.fetch_s,
            "compute_s": max(0.0, float(sum(steps)) - self.select_s - self.fetch_s) if steps else 0.0,
            "decode_steps": len(steps),
            "attended_per_layer": [_mean(a) for a in self.attended],
            "attended_first_step": [a[0] if a else None for a in self.attended],
            "available_first_step": [a[0] if a else None for a in self.available],
            "kept_per_layer": self.kept_after_prefill,
            "kv_bytes_after_prefill": self.kv_bytes_after_prefill,
            "recall": _mean(recall_all),
            "recall_per_layer": recall_layers if recall_all else None,
            **({"recall_b": self.recall_b} if self.recall_b is not None else {}),
            **({"selection_digest": self._digest.hexdigest()[:16]} if self._digest is not None else {}),
            **({"prepared": self.prepared} if self.prepared else {}),
            **({"prefill": self.prefill_plan} if self.prefill_plan else {}),
        }
