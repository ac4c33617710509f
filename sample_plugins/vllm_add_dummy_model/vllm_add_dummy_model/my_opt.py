# Ported from vLLM's tests/plugins/vllm_add_dummy_model/vllm_add_dummy_model/my_opt.py: only the
# import changed (vllm.model_executor.models.opt -> builtin_models.opt).

import torch

from builtin_models.opt import OPTForCausalLM


class MyOPTForCausalLM(OPTForCausalLM):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # this dummy model always predicts the first token
        logits = super().compute_logits(hidden_states)
        if logits is not None:
            logits.zero_()
            logits[:, 0] += 1.0
        return logits
