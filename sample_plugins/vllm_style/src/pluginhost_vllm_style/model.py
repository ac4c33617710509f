"""OPT that never generates the token ids its config bans."""

import torch

from builtin_models.opt import OPTForCausalLM

__all__ = ["BannedTokensOPT"]


class BannedTokensOPT(OPTForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        banned = getattr(config, "banned_token_ids", None) or []
        if not isinstance(banned, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < config.vocab_size for t in banned
        ):
            raise ValueError(
                f"banned_token_ids must be a list of token ids in [0, {config.vocab_size}) (the vocabulary), "
                f"got {banned!r}"
            )
        self.banned_token_ids = banned

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        if self.banned_token_ids:
            logits[..., self.banned_token_ids] = torch.finfo(logits.dtype).min
        return logits
