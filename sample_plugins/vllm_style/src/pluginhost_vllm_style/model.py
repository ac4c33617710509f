"""OPT that never generates the token ids its config bans."""

import torch

from builtin_models.opt import OPTForCausalLM

__all__ = ["BannedTokensOPT"]


class BannedTokensOPT(OPTForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.banned_token_ids = [int(t) for t in getattr(config, "banned_token_ids", None) or []]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        if self.banned_token_ids:
            logits[..., self.banned_token_ids] = torch.finfo(logits.dtype).min
        return logits
