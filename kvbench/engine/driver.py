"""Driving a causal LM layer by layer, with explicit positions.

transformers' ``model(...)`` is one opaque call: embeddings, every decoder layer, the final norm and
the head, with positions implied by the input. Reuse methods need more (LMCache and vLLM drive
prefill the same way): a plan decides, *between* layers, which rows of the residual stream stay
active (CacheBlend drops the tokens it does not recompute after its check layer), and every row
carries its real position, which need not be contiguous. :class:`ModelDriver` exposes the pieces of
a Llama-family model (Llama, Mistral, Qwen2/3, GLM-4: ``model.model.{embed_tokens, layers, norm,
rotary_emb}`` and ``model.lm_head``) so the engine can run them itself:

* :meth:`embed` — token ids → hidden states ``[1, t, hidden]``;
* :meth:`rotary` — the model's own rotary embedding (cos, sin) at any positions ``[t]``;
* :meth:`layer` — one stock decoder layer (its norms, attention through the registered kvbench
  attention function, MLP) on the active rows, with their positions' rotary embedding;
* :meth:`layer_cut` — the same layer, but the rows that continue are decided by its attention and
  only they go through the output projection, the residual and the MLP (CacheBlend's check layer, as
  its released code and LMCache run it: Q/K/V for every row, the rest for the selected ones);
* :meth:`logits` — final norm and head of the last row only (``logits_to_keep=1``).

Running the same modules in the same order as ``model.forward`` does, with the same tensors, gives
bit-identical logits (``tests/test_engine.py`` checks ``full`` against ``model.generate``); the
attention mask transformers would build is not needed, because the kvbench attention function
builds its own from positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvbench.errors import ConfigError

#: model types whose decoder layer is ``x + o(attn(norm(x)))`` then ``x + mlp(norm(x))`` (what
#: :meth:`ModelDriver.layer_cut` runs itself; GLM-4 adds norms after attention and MLP)
CUT_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class ModelDriver:
    """The pieces of one causal LM, run one at a time."""

    def __init__(self, model: Any) -> None:
        base = getattr(model, "model", None)
        missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, name)]
        if base is None or missing or not hasattr(model, "lm_head"):
            raise ConfigError(
                f"kvbench cannot drive {type(model).__name__} layer by layer "
                f"(missing {', '.join(missing) or 'lm_head'})",
                "use a Llama-family architecture (llama, mistral, qwen2, qwen3, glm4)",
            )
        self.model = model
        self.base = base
        self.layers = list(base.layers[: model.config.num_hidden_layers])
        self.n_layers = len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[1, t, hidden]`` of ``input_ids`` ``[1, t]``."""
        return self.base.embed_tokens(input_ids)

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary embedding at ``positions`` ``[t]`` (cos, sin), in ``hidden``'s dtype."""
        return self.base.rotary_emb(hidden, positions.view(1, -1))

    def layer(
        self, index: int, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
    ) -> torch.Tensor:
        """Decoder layer ``index`` on ``hidden`` ``[1, t, hidden]``; the attention runs through kvbench."""
        return self.layers[index](
            hidden, attention_mask=None, position_ids=positions.view(1, -1), position_embeddings=rotary
        )

    def layer_cut(
        self,
        index: int,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rows: Callable[[], torch.Tensor | None],
    ) -> tuple[torch.Tensor, bool]:
        """Decoder layer ``index`` where ``rows()``, asked once the attention has run, names the rows that
        continue (indices into ``hidden``'s rows, or None for all): only they go through the output
        projection, the residual add and the MLP. Returns the hidden states of those rows and whether
        the cut was made here. The stock layer's order of operations is kept (the Llama-family layer:
        ``x + o(attn)`` then ``x + mlp(norm(x))``); a model whose layer has another shape
        (:data:`CUT_ARCHS`) runs whole, and the caller cuts after it."""
        if self.model.config.model_type not in CUT_ARCHS:
            return self.layer(index, hidden, rotary, positions), False
        layer = self.layers[index]
        chosen: list[torch.Tensor | None] = []

        def cut_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            keep = rows()
            chosen.append(keep)
            return None if keep is None else (args[0].index_select(1, keep),)

        handle = layer.self_attn.o_proj.register_forward_pre_hook(cut_input)
        try:
            attended, _ = layer.self_attn(
                hidden_states=layer.input_layernorm(hidden),
                attention_mask=None,
                position_ids=positions.view(1, -1),
                position_embeddings=rotary,
            )
        finally:
            handle.remove()
        keep = chosen[0] if chosen else None
        residual = hidden if keep is None else hidden.index_select(1, keep)
        hidden = residual + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), keep is not None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[1, vocab]`` of the last row of ``hidden``."""
        return self.model.lm_head(self.base.norm(hidden[:, -1:, :]))[:, -1, :]
