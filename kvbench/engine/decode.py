"""The static decode step: what a CUDA graph can capture, and what the host does around it.

A decode step of the earlier engine read its lengths and positions on the host, copied positions to
the device in every layer, and read the next token back before the next step could start; on a GPU
that measured the Python loop, not the method (RESULTS §9). :class:`StaticDecoder` runs the step the
way SGLang's graph runner and transformers' ``StaticCache`` do:

* **buffers allocated once per request** — every layer's K/V/position buffers have room for the whole
  generation before the first step (:meth:`~kvbench.kv.store.LayerKV.reserve`) and are written in place
  with ``index_copy_`` at a device-side slot (:meth:`~kvbench.kv.store.LayerKV.write_current`);
* **counters on the device** — per-layer lengths, the position, the step and the produced count are
  device tensors the step itself advances; the host keeps its own copies of the same numbers (each step
  adds exactly one token), so it never reads them back;
* **the next token chosen on the device** — argmax (with the stop ids masked while fewer than
  ``min_new_tokens`` exist) written into the next step's input; the host reads the generated tokens
  every ``engine.readback_every`` steps to test for stops (:func:`greedy`);
* **fixed shapes** — attention runs over a buffer prefix that grows in buckets of
  ``engine.bucket_tokens`` slots with the slots past the length masked, and a method's selection has
  one shape for the whole regime (:meth:`KVMethod.decode_key`), padded entries masked;
* **figures on the device** — the tokens each layer attends are written into a device buffer and read
  with the tokens.

Within one *regime* — the bucket of every layer, whether stop ids are masked, and the method's own
:meth:`~kvbench.engine.protocol.KVMethod.decode_key` (a budget that covers everything, a recluster epoch)
— every step issues the same ops with the same shapes and arguments (``tests/test_decode_static.py``
checks it with :mod:`kvbench.engine.ops`). On CUDA the step is captured into a graph at the second step
of a regime (the first runs eagerly and is the warm-up) and replayed from then on
(``engine.cuda_graph``); work a method must do on the host side of a step (ClusterKV's reclustering,
InfLLM's new blocks) runs in :meth:`~kvbench.engine.protocol.KVMethod.before_step`, outside the graph.

Layers of a method without a static step (``static_decode = False``: the decode-time eviction of H2O)
run the earlier per-layer code (:meth:`GenerationContext.dynamic_decode`) inside the
same loop; the step is then eager. Host-tier layers (``offload``) write through a host-known slot and
count their fetches on the host (a sync per layer, the offload experiment's cost).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvbench.engine import attention, lean
from kvbench.engine.settings import EngineSettings
from kvbench.errors import ConfigError

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext
    from kvbench.kv.store import LayerKV

STATIC, OFFLOAD, DYNAMIC = "static", "offload", "dynamic"


class StepTimer:
    """Per-step wall times: host clock on a CPU, CUDA events on a GPU (read when the tokens are read)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Any, Any, float]] = []  # (start, end, host seconds to exclude)
        self.host: list[tuple[float, float]] = []

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any, excluded: float) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((started, end, excluded))
        else:
            self.host.append((time.perf_counter() - started, excluded))

    def drain(self) -> list[float]:
        """Seconds of the steps timed since the last drain (waits for the last CUDA event)."""
        if self.cuda:
            if self.pending:
                self.pending[-1][1].synchronize()
            out = [max(0.0, start.elapsed_time(end) / 1e3 - excl) for start, end, excl in self.pending]
            self.pending.clear()
            return out
        out = [max(0.0, seconds - excl) for seconds, excl in self.host]
        self.host.clear()
        return out


class StaticDecoder:
    """The decode steps of one request (module docstring)."""

    def __init__(self, ctx: GenerationContext, settings: EngineSettings, steps: int) -> None:
        # the context owns its decoder: a weak reference back leaves no cycle, so a finished request's
        # buffers (its K/V, the graphs' pool) are freed when the context is, not at Python's next cycle
        # collection (a GPU held several requests' caches at once before: RESULTS §10b)
        self.ctx: GenerationContext = weakref.proxy(ctx)
        self.settings = settings
        spec = ctx.spec
        self.device = torch.device(spec.device)
        self.method = ctx.method
        self.store = ctx.store
        self.driver = ctx.driver
        self.shape = (spec.n_heads, spec.n_kv_heads, spec.head_dim)
        self.scaling = spec.head_dim**-0.5
        self.dtype = next(ctx.model.parameters()).dtype
        self.kernel = decode_kernel(settings, self.device)
        self.weights = [lean.layer_weights(layer) for layer in self.driver.layers] if lean.supports(ctx.model) else None
        static = self.method.static_decode
        self.kinds = [DYNAMIC if not static else OFFLOAD if kv.offload else STATIC for kv in self.store.layers]
        self.dense = set(self.method.dense_layers)
        self.profiled = ctx.profile.recall or ctx.profile.selection_digest
        eager_only = self.profiled or DYNAMIC in self.kinds  # host reads inside the step anyway
        self.readback = 1 if eager_only else settings.readback(self.device)
        # a graph replays device work only: host-tier layers (offload) count bytes on the host, profiling reads
        self.graphs_on = settings.graphs_on(self.device) and set(self.kinds) == {STATIC} and not self.profiled
        # telemetry rows between reads: a generation reads every `readback` steps (outside the step); a
        # caller that never reads (a conversation feeding tokens) is flushed when the buffer is full
        self.rows = max(self.readback, 32) + 1
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self._minus_inf = torch.full((), float("-inf"), dtype=self.dtype, device=self.device)
        self.timer = StepTimer(self.device)
        self.graphs: dict[Any, Any] = {}
        self.traces: dict[Any, dict[int, Any]] = {}  # regime -> per layer: "dense", a count, or "device"
        self._trace: dict[int, Any] = {}
        self._pending: list[tuple[int, int, int, int]] = []  # (layer, telemetry index, buffer row, rows) to fill
        self._pool: Any = None
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self.steps = 0  # steps run (host count)
        self.unread = 0  # steps since the last read
        self.stop_mask: torch.Tensor | None = None
        self.scoring: torch.Tensor | None = None
        self.min_new = 0
        self.host_produced = 0
        self._allocate(steps)

    # ------------------------------------------------------------------ state
    def _allocate(self, steps: int) -> None:
        """Room for ``steps`` more tokens in every layer, and the device-side counters."""
        d = self.device
        for kv in self.store.layers:
            kv.reserve(steps)
        self.out = torch.zeros(max(1, steps + 1), dtype=torch.long, device=d)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=d)
        self.produced = torch.zeros(1, dtype=torch.long, device=d)
        self.position = torch.zeros(1, dtype=torch.long, device=d)
        self.row = torch.zeros(1, dtype=torch.long, device=d)
        self.attended = torch.zeros(self.rows, len(self.store.layers), dtype=torch.float32, device=d)
        self.capacity = [kv.capacity for kv in self.store.layers]
        self.rotary = self._rotary_tables(self.ctx.next_position + steps + 1)
        self.sync()

    def _rotary_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, ±sin)`` ``[positions, d]`` of every position a step may take, made once (the model's own
        rotary embedding over all of them: the same per-element products and cos/sin as at one position),
        for a rotary embedding that depends on the position only; ``None`` for one that rescales with the
        length (``dynamic``, ``longrope``), which runs per step."""
        rotary = self.driver.base.rotary_emb
        if self.weights is None or getattr(rotary, "rope_type", "default") not in ("default", "linear", "llama3"):
            return None
        probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=self.device)
        cos, sin = self.driver.rotary(probe, torch.arange(positions, device=self.device))
        half = sin.shape[-1] // 2
        return cos[0].contiguous(), torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def sync(self) -> None:
        """Set the device counters from the host's (at the start, and after the host changed the store:
        a multi-token pass, a rollback): one host→device copy, outside any step."""
        layers = self.store.layers
        self.lengths = torch.tensor([kv.n for kv in layers], dtype=torch.long, device=self.device)
        self.current = self.lengths - 1
        self.host_n = [kv.n for kv in layers]
        self.host_position = self.ctx.next_position
        self.position.fill_(self.host_position)
        for layer, kv in enumerate(layers):
            kv.bind(self.lengths[layer : layer + 1], self.current[layer : layer + 1], kv.bucket_end)
        self.graphs.clear()  # captured graphs hold the old counters
        self.traces.clear()

    def _check_host(self) -> None:
        """Re-sync when the store changed outside the static steps (or a layer's buffer was reallocated),
        and make room when a layer is full (a conversation longer than its estimate)."""
        layers = self.store.layers
        for layer, kv in enumerate(layers):
            if self.kinds[layer] != DYNAMIC and kv.n >= kv.capacity:
                kv.reserve(max(64, kv.n // 4))
        moved = any(kv.n != n for kv, n in zip(layers, self.host_n)) or self.ctx.next_position != self.host_position
        grown = any(kv.capacity != c for kv, c in zip(layers, self.capacity))
        if moved or grown:
            self.capacity = [kv.capacity for kv in layers]
            self.sync()

    def begin(self, produced: int = 0, min_new_tokens: int = 0, stop_ids: Sequence[int] = ()) -> None:
        """A new generation: ``produced`` tokens exist (the first was chosen from the prefill's logits)."""
        self._check_host()
        self.produced.fill_(produced)
        self.min_new = min_new_tokens
        self.stop_mask = None
        if stop_ids and min_new_tokens > 0:
            vocab = self.ctx.model.config.vocab_size
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[[i for i in stop_ids if 0 <= i < vocab]] = True
            self.stop_mask = mask.to(self.device)
        self.host_produced = produced

    # ------------------------------------------------------------------ host side of a step
    def _advance_host(self) -> None:
        """The numbers of the step about to run, on the host: every static layer holds one more token."""
        bucket = self.settings.bucket_tokens
        position = self.host_position
        for layer, kv in enumerate(self.store.layers):
            if self.kinds[layer] == DYNAMIC:
                continue
            kv.n += 1
            kv.seen = max(kv.seen, position + 1)
            kv.bucket_end = min(kv.capacity, -(-kv.n // bucket) * bucket)
        self.host_n = [kv.n for kv in self.store.layers]

    def regime(self) -> tuple[Any, ...]:
        """What fixes a step's op stream (module docstring)."""
        buckets = tuple(kv.bucket_end for kv in self.store.layers)
        masking = self.stop_mask is not None and self.host_produced < self.min_new
        return (buckets, masking, self.method.decode_key())

    def step(self, feed: int | None = None, timed: bool = True) -> torch.Tensor:
        """One decode step; returns its logits ``[1, vocab]``. ``feed``: the input token (a host value: the
        step runs eagerly) or ``None``: the token the previous step chose on the device. ``timed``: the
        step's time goes into the telemetry's step times (a caller that times its own steps says no)."""
        self._check_host()
        if self.rotary is not None and self.host_position >= self.rotary[0].shape[0]:  # (a long conversation)
            self.rotary = self._rotary_tables(2 * self.host_position + 1)
            self.graphs.clear()
            self.traces.clear()
        tele = self.ctx.telemetry
        tele.excluded_s = 0.0
        started = self.timer.start() if timed else None
        self._advance_host()
        self.method.before_step(self.ctx)
        if feed is not None:
            self.token.fill_(int(feed))
        choose = feed is None and self.scoring is None
        key = (self.regime(), choose)
        if self.graphs_on and feed is None and key in self.traces:
            logits = self._replay(key, choose)
        else:
            self._trace = {}
            logits = self._warm_up(choose) if self.graphs_on else self._device_step(choose)
            self.traces[key] = self._trace
        if timed:
            self.timer.stop(started, tele.excluded_s)
        self._finish_host(self.traces[key])
        return logits

    def _finish_host(self, trace: dict[int, Any]) -> None:
        """The host's figures of the step that ran: what each layer attended (known on the host for a
        dense layer and a fixed-size selection, else read later from the device buffer)."""
        tele = self.ctx.telemetry
        row = self.unread
        for layer, kv in enumerate(self.store.layers):
            if self.kinds[layer] == DYNAMIC:
                continue
            what = trace[layer]
            tele.available[layer].append(kv.seen)
            if what == "dense":
                tele.attended[layer].append(kv.n)
            elif isinstance(what, tuple):  # ("device", rows): read with the next flush
                self._pending.append((layer, len(tele.attended[layer]), row, what[1]))
                tele.attended[layer].append(-1)
            else:
                tele.attended[layer].append(what)
        self.host_position += 1
        self.ctx.next_position = self.host_position
        self.host_produced += 1
        self.steps += 1
        self.unread += 1
        if self.unread >= self.rows - 1:
            self.flush()

    def flush(self) -> None:
        """Read the figures of the steps since the last read (the attended counts a masked selection
        left on the device, step times) into the telemetry: done with the tokens' read."""
        if not self.unread:
            return
        tele = self.ctx.telemetry
        if self._pending:
            counts = self.attended[: self.unread].tolist()
            for layer, index, row, rows in self._pending:
                tele.attended[layer][index] = counts[row][layer] / rows
            self._pending.clear()
        tele.step_s.extend(self.timer.drain())
        self.row.zero_()
        self.unread = 0

    # ------------------------------------------------------------------ the device step
    def _device_step(self, choose: bool) -> torch.Tensor:
        """Every op of a step (what a graph captures): counters, layers, head, the next token."""
        self._masks = {}
        self.lengths.add_(1)
        torch.sub(self.lengths, 1, out=self.current)
        hidden = self.driver.embed(self.token)
        if self.weights is not None and self.rotary is not None:  # this position's row of the tables
            c = self.rotary[0].index_select(0, self.position)[0]
            s = self.rotary[1].index_select(0, self.position)[0]
            x = hidden[0]
            for index, weights in enumerate(self.weights):
                x = lean.lean_layer(index, weights, x, c, s, self.shape, self.attend)
            norm = self.driver.base.norm
            logits = self.driver.model.lm_head(lean.rms_norm(x, norm.weight, float(norm.variance_epsilon)))
        elif self.weights is not None:
            c, s = lean.rotary_tables(*self.driver.rotary(hidden, self.position))
            x = hidden[0]
            for index, weights in enumerate(self.weights):
                x = lean.lean_layer(index, weights, x, c, s, self.shape, self.attend)
            logits = self.driver.logits(x[None])
        else:
            cos, sin = self.driver.rotary(hidden, self.position)
            self.ctx.decoder_active = self
            try:
                for index in range(self.driver.n_layers):
                    hidden = self.driver.layer(index, hidden, (cos, sin), self.position)
            finally:
                self.ctx.decoder_active = None
            logits = self.driver.logits(hidden)
        if choose:
            self._choose(logits)
        if self.scoring is not None:
            self._score(logits)
        self.position.add_(1)
        self.row.add_(1)
        return logits

    def _choose(self, logits: torch.Tensor) -> None:
        """Greedy choice on the device, into the next step's input and the output buffer."""
        if self.stop_mask is not None and self.host_produced < self.min_new:
            logits = logits.masked_fill(self.stop_mask, float("-inf"))
        chosen = torch.argmax(logits, dim=-1)
        self.token.copy_(chosen.view(1, 1))
        self.out.index_copy_(0, self.produced, chosen)
        self.produced.add_(1)

    def choose_first(self, logits: torch.Tensor) -> None:
        """The first token, from the prefill's logits (eager: part of TTFT)."""
        self._choose(logits)
        self.host_produced += 1

    def start_scoring(self, targets: Sequence[int]) -> None:
        """Teacher forcing: every step feeds the next target and scores the one after it."""
        self.scoring = torch.tensor(list(targets), dtype=torch.long, device=self.device)
        self.scores = torch.zeros(len(targets), dtype=torch.float32, device=self.device)

    def score_first(self, logits: torch.Tensor) -> None:
        """The first target's NLL from the prefill's logits."""
        self._score(logits)
        self.host_produced += 1

    def read_scores(self, count: int) -> list[float]:
        self.flush()
        return self.scores[:count].tolist()

    def _score(self, logits: torch.Tensor) -> None:
        """Teacher forcing: the next target's negative log-likelihood into :attr:`scores`, the target
        itself into the next step's input."""
        assert self.scoring is not None
        target = torch.index_select(self.scoring, 0, self.produced)
        nll = -torch.log_softmax(logits.float(), dim=-1).gather(1, target.view(1, 1))
        self.scores.index_copy_(0, self.produced, nll.view(1))
        self.token.copy_(target.view(1, 1))
        self.produced.add_(1)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One layer's decode attention (``[1, H, 1, d]`` query, ``[1, H_kv, 1, d]`` key/value) → ``[1, 1, H, d]``."""
        kind = self.kinds[layer]
        if kind == DYNAMIC:
            return self.ctx.dynamic_decode(layer, query, key, value, self.scaling, self.host_position)
        kv = self.store[layer]
        if kind == STATIC:
            kv.write_current(key[0], value[0], self.position)
        else:
            kv.write_slot(kv.n - 1, key[0], value[0], self.position)
        tele = self.ctx.telemetry
        started = time.perf_counter()
        selection = None if layer in self.dense else self.method.select(layer, query, kv)
        selected_at = time.perf_counter()
        tele.select_s += selected_at - started
        if selection is None:
            if kind == STATIC:
                keys, values = kv.bucket()
                out = attention.decode_dense(
                    query, keys, values, self._mask(kv), self.scaling, self.kernel, self.settings.split_tokens
                )
                valid = self._held_valid(kv) if self.method.needs_attention_probs else None
            else:
                keys, values = kv.held()
                out = attention.selected(query, keys, values, self.scaling)
                valid = None
            self._trace[layer] = "dense"
        else:
            keys, values = kv.gather(selection.slots, selection.cached)
            tele.fetch_s += time.perf_counter() - selected_at
            valid = selection.valid
            mask = None if valid is None else attention.valid_mask(valid, self._zero, self._minus_inf)
            out = attention.selected(query, keys, values, self.scaling, mask)
            if valid is None:
                self._trace[layer] = int(selection.slots.shape[1])
            else:  # attended entries over every row (the host divides by the rows when it reads them)
                self.attended.select(1, layer).index_copy_(0, self.row, valid.sum(dtype=torch.float32).view(1))
                self._trace[layer] = ("device", valid.shape[0])
        if self.method.needs_attention_probs:
            probs = attention.probabilities(query, keys, self.scaling, valid)
            self.method.after_attention(layer, query, selection, kv, probs)
        if self.profiled:
            self.ctx.profile_step(layer, query, selection, kv, self.scaling)
        return out

    def _mask(self, kv: LayerKV) -> torch.Tensor:
        """This step's length mask of ``kv``'s bucket (made once per step for layers of equal length)."""
        key = (kv.bucket_end, kv.n)
        mask = self._masks.get(key)
        if mask is None:
            assert kv.length is not None
            mask = self._masks[key] = attention.length_mask(kv.iota(kv.bucket_end), kv.length, self.dtype)
        return mask

    @staticmethod
    def _held_valid(kv: LayerKV) -> torch.Tensor:
        assert kv.length is not None
        return (kv.iota(kv.bucket_end) < kv.length).expand(kv._k.shape[0], -1)

    # ------------------------------------------------------------------ CUDA graphs
    def _warm_up(self, choose: bool) -> torch.Tensor:
        """A regime's first step, eager, on a side stream (PyTorch's rule before a capture: lazy library
        state is made off the capturing stream); the model's stream waits for it."""
        current = torch.cuda.current_stream(self.device)
        if not hasattr(self, "_side"):
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            logits = self._device_step(choose)
        current.wait_stream(self._side)
        return logits

    def _replay(self, key: Any, choose: bool) -> torch.Tensor:
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, choose)
        graph[0].replay()
        return graph[1]

    def _capture(self, key: Any, choose: bool) -> tuple[Any, torch.Tensor]:
        """Record this regime's step (recording runs nothing: the replay that follows is the step)."""
        # the counters were advanced for this step by no kernel yet: the capture records, the replay runs
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._device_step(choose)
        self.graphs[key] = (graph, logits)
        return self.graphs[key]

    # ------------------------------------------------------------------ reads
    def tokens(self, count: int) -> list[int]:
        """The first ``count`` generated tokens (a read of the device)."""
        self.flush()
        return self.out[:count].tolist()


def decode_kernel(settings: EngineSettings, device: torch.device) -> str:
    """``engine.decode_attention`` for ``device``: ``split`` on CUDA needs Triton (one clear error if absent)."""
    if settings.decode_attention == "split" and device.type == "cuda":
        from kvbench.engine import split_decode

        if not split_decode.available():
            raise ConfigError(
                "engine.decode_attention=split needs Triton on CUDA, and it cannot be imported",
                "install the triton that matches torch, or use engine.decode_attention=matmul or sdpa",
            )
    return settings.decode_attention


def greedy(
    decoder: StaticDecoder,
    *,
    max_new_tokens: int,
    stops: set[int],
    stop_texts: Sequence[str],
    tokenizer: Any,
    on_first_step: Any = None,
) -> tuple[list[int], str]:
    """Greedy generation after the first token was chosen (:meth:`StaticDecoder.choose_first`): the
    tokens (the stop token included when one ended it) and the stop reason, exactly as the earlier loop
    decided them token by token.

    The tokens are read every ``decoder.readback`` steps; a stop found in a read ends the generation at
    that token, and the steps that ran past it are dropped from the telemetry (their tokens never
    reach the output: greedy decoding is causal)."""
    from kvbench.engine.generate import _find_stop

    tele = decoder.ctx.telemetry
    steps_before = len(tele.step_s)
    produced = 1  # tokens that exist on the device
    tokens: list[int] = []
    while True:
        if produced - len(tokens) >= decoder.readback or produced >= max_new_tokens or not tokens:
            for token in decoder.tokens(produced)[len(tokens) :]:
                tokens.append(token)
                if len(tokens) > 1 and stop_texts:
                    if _find_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop_texts) >= 0:
                        return _trim(decoder, tokens, steps_before, "stop_text")
                if token in stops:
                    return _trim(decoder, tokens, steps_before, "stop")
                if len(tokens) >= max_new_tokens:
                    return _trim(decoder, tokens, steps_before, "length")
        decoder.step()
        produced += 1
        if produced == 2 and on_first_step is not None:
            decoder.flush()
            on_first_step()


def _trim(decoder: StaticDecoder, tokens: list[int], steps_before: int, reason: str) -> tuple[list[int], str]:
    """Drop the figures of the steps that ran past the last kept token (it came from step ``len - 1``)."""
    decoder.flush()
    tele = decoder.ctx.telemetry
    keep = steps_before + len(tokens) - 1
    extra = len(tele.step_s) - keep
    if extra > 0:
        del tele.step_s[keep:]
        for layer, kind in enumerate(decoder.kinds):
            if kind != DYNAMIC:
                del tele.attended[layer][len(tele.attended[layer]) - extra :]
                del tele.available[layer][len(tele.available[layer]) - extra :]
    return tokens, reason
