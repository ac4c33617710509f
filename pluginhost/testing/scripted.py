"""A model that writes a given text whatever its weights say, for tests of what is done with the text.

``scripted_opt(script)`` is an OPT (``builtin_models.opt.OPTForCausalLM``) whose next token after
position p is always ``script[p + 1]``: register it for ``OPTForCausalLM`` (``RegistersModel``) and
a greedy request from the prompt ``[script[0]]`` writes ``script[1:]``. Its KV cache is used as the
real model's, so batching, preemption and detokenization run as they would on real weights.
"""

from __future__ import annotations

import torch

from builtin_models.opt import OPTForCausalLM

__all__ = ["scripted_opt"]


def scripted_opt(script: list[int]) -> type[OPTForCausalLM]:
    """A subclass of OPT writing ``script`` (its own class: ``.script`` may be set later, shared by no other)."""

    class ScriptedOPT(OPTForCausalLM):
        def forward(self, input_ids, positions, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            hidden = super().forward(input_ids, positions, *args, **kwargs)  # (B, T, W): the cache is still used
            return positions[..., None].to(hidden.dtype).expand(hidden.shape).contiguous()  # (B, T, W): positions

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            following = (hidden_states[..., 0].long() + 1) % len(self.script)
            logits = torch.full((*hidden_states.shape[:-1], self.config.vocab_size), -1e9)
            return logits.scatter_(-1, torch.tensor(self.script)[following][..., None], 0.0)

    ScriptedOPT.script = list(script)
    return ScriptedOPT
