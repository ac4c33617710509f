"""The mock model: builtin OPT with a forced prediction."""

import torch

from builtin_models.opt import OPTForCausalLM

__all__ = ["DEFAULT_TOKEN_ID", "MockOPTForCausalLM"]

#: The token the mock predicts unless the HF config sets ``mock_token_id``.
DEFAULT_TOKEN_ID = 7


class MockOPTForCausalLM(OPTForCausalLM):
    """OPT that runs the real forward pass but always predicts ``mock_token_id``."""

    def __init__(self, config):
        super().__init__(config)
        token = getattr(config, "mock_token_id", DEFAULT_TOKEN_ID)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < config.vocab_size:
            raise ValueError(
                f"mock_token_id must be a token id in [0, {config.vocab_size}) (the vocabulary), got {token!r}"
            )
        self.mock_token_id = token

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        forced = torch.full_like(logits, torch.finfo(logits.dtype).min)
        forced[..., self.mock_token_id] = 0.0
        return forced
