"""Sampling with vLLM's meanings: penalties, min_p, min_tokens, stop strings, n samples.

Each feature is checked against an independent reference: transformers'
``generate`` for the repetition penalty, a step-by-step loop over transformers'
full forward passes for the presence and frequency penalties, the model's own
distribution for ``min_p``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import OPTForCausalLM as HFOPTForCausalLM

from builtin_models.opt import OPTForCausalLM
from pluginhost import LLM, SamplingParams
from pluginhost.engine import sampler
from pluginhost.engine.detokenizer import IncrementalDetokenizer
from pluginhost.engine.sampler import NoTokenLeft, SamplingState, TokenChoices
from pluginhost.testing import RegistersModel
from pluginhost.testing.models import byte_fallback_tokenizer
from pluginhost.testing.scripted import scripted_opt
from pluginhost.tokenizer import token_bytes

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300, 300, 12], [2, 7, 7, 7, 150, 42]]


@pytest.fixture(scope="module")
def reference(tiny_opt) -> HFOPTForCausalLM:
    return HFOPTForCausalLM.from_pretrained(tiny_opt, attn_implementation="eager", dtype=torch.float32).eval()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 12, **kwargs})


@torch.no_grad()
def transformers_greedy(reference: HFOPTForCausalLM, **generate_kwargs) -> list[list[int]]:
    """transformers' greedy ``generate`` on ``PROMPTS`` (12 new tokens each, end-of-sequence ignored)."""
    return [
        reference.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=1, **generate_kwargs
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]


# -- penalties ----------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 2.5, 0.7])
def test_repetition_penalty_equals_transformers_generate(llm, reference, penalty):
    plain = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    ours = [o.token_ids for o in llm.generate(PROMPTS, greedy(repetition_penalty=penalty))]
    assert ours == transformers_greedy(reference, repetition_penalty=penalty)
    assert ours != plain  # the penalty changed something, so the comparison means something


@torch.no_grad()
def reference_penalized(model: HFOPTForCausalLM, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy decoding with vLLM's presence/frequency penalties, over transformers' full forward passes."""
    out: list[int] = []
    for _ in range(12):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
        logits -= frequency * counts + presence * (counts > 0).float()  # generated tokens only
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.8), (0.5, 1.2), (-2.0, 0.0)])
def test_presence_and_frequency_penalties_count_generated_tokens_only(llm, reference, presence, frequency):
    params = greedy(presence_penalty=presence, frequency_penalty=frequency)
    ours = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert ours == [reference_penalized(reference, p, presence, frequency) for p in PROMPTS]
    assert ours != [o.token_ids for o in llm.generate(PROMPTS, greedy())]


def test_a_prompt_token_is_not_penalised_by_presence(llm):
    """Penalising the prompt would push the prompt's own tokens down at the first step; vLLM does not."""
    first = llm.generate([PROMPTS[0]], greedy(max_tokens=1, logprobs=0))[0].token_ids[0]
    prompt = [2, first, first, first]  # the would-be first token, all over the prompt
    free = llm.generate([prompt], greedy(max_tokens=1))[0].token_ids
    assert llm.generate([prompt], greedy(max_tokens=1, presence_penalty=2.0))[0].token_ids == free


# -- min_p, min_tokens ----------------------------------------------------------------------


def test_a_penalty_overflowing_float32_samples_its_limit_and_fails_no_other_request(llm):
    # repetition_penalty=1e-45 divides every positive logit of a seen token to +inf in float32: softmax gave NaN
    # and the draw failed the whole step, batch-mates included. Its limit is the seen token of the largest
    # positive logit, with probability 1.
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = llm.model.compute_logits(llm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None]))[0, -1]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[prompt] = True
    assert (logits[seen] > 0).sum() >= 2  # several seen tokens go to +inf: their order decides
    expected = int(torch.where(seen & (logits > 0), logits, float("-inf")).argmax())
    for seed in range(5):
        tiny = SamplingParams(max_tokens=3, temperature=1.0, repetition_penalty=1e-45, seed=seed, ignore_eos=True)
        outs = llm.generate([prompt, PROMPTS[1]], [tiny, greedy(max_tokens=3)])
        assert outs[0].token_ids[0] == expected and len(outs[0].token_ids) == 3
        assert outs[1].token_ids == llm.generate([PROMPTS[1]], greedy(max_tokens=3))[0].token_ids


@pytest.mark.parametrize(
    ("logits", "penalty", "expected"),
    [
        ([5.0, 3.0, float("inf"), -2.0], 1.2, 2),  # a processor's +inf ("this token, surely"): it stays sure
        ([5.0, 3.0, 1.0, -2.0], 5e-324, 0),  # overflows float64 too: the largest seen positive logit
        ([3.0, 5.0, 1.0, -2.0], 1e-38, 1),
    ],
)
def test_the_repetition_penalty_keeps_a_certain_token_certain(logits, penalty, expected):
    # A processor's +inf with any penalty made the whole step fail (inf - inf is NaN in the overflow path).
    from pluginhost.engine.sampler import SamplingState, sample

    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, repetition_penalty=penalty)
        state = SamplingState(params, torch.Generator().manual_seed(0), [0, 1, 2], frozenset(), 4, torch.device("cpu"))
        assert sample(torch.tensor([logits]), [state]) == [expected]


def test_min_p_only_keeps_tokens_near_the_most_likely(llm):
    min_p = 0.2
    chosen = set()
    # The most likely token's log-probability, from a greedy step: the sampled steps' own reports must not decide it
    # (had they lost the most likely token, every draw would have been measured against itself).
    top = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=0))[0]
    best = top.logprobs[0][top.token_ids[0]]
    for seed in range(30):
        params = SamplingParams(temperature=1.0, min_p=min_p, seed=seed, max_tokens=1, logprobs=0)
        out = llm.generate([PROMPTS[0]], params)[0]
        token = out.token_ids[0]
        assert out.logprobs[0][token] >= best + math.log(min_p) - 1e-6
        chosen.add(token)
    assert len(chosen) > 1  # still sampling, not greedy


def filtered_by_transformers(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row (V,) is drawn from, through transformers' own warpers in vLLM's order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(params.temperature)]
    warpers += [MinPLogitsWarper(params.min_p)] if params.min_p > 0 else []
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k > 0 else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    scores = logits[None].double()
    for warper in warpers:
        scores = warper(None, scores)
    return scores[0].softmax(dim=-1)


def state_of(params: SamplingParams, seed: int = 0, vocab_size: int = 8) -> SamplingState:
    """A sequence's sampling state on the CPU: prompt ``[2]``, stop token 2, its own seeded stream."""
    return SamplingState(
        params, torch.Generator().manual_seed(seed), [2], frozenset({2}), vocab_size, torch.device("cpu")
    )


def filtered_alone(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The row ``row`` (V,) through the sampler's filters in a batch of its own (a copy)."""
    from pluginhost.engine.sampler import _filter

    alone = row[None].clone()
    _filter(alone, [params])
    return alone[0]


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """``n`` tokens drawn for the row ``logits`` (V,), each from its own seeded stream, in one batch."""
    from pluginhost.engine.sampler import sample

    V = logits.shape[-1]
    return torch.tensor(sample(logits.expand(n, V), [state_of(params, i, V) for i in range(n)]))


@pytest.mark.parametrize(
    ("temperature", "min_p", "top_k", "top_p"),
    [(1.0, 0.0, 0, 1.0), (0.6, 0.0, 0, 0.8), (1.5, 0.0, 3, 1.0), (1.0, 0.15, 0, 0.97), (0.8, 0.0, 5, 0.5)],
)
def test_draws_follow_the_filtered_distribution(temperature, min_p, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
    expected = filtered_by_transformers(logits, params)
    n = 20_000
    drawn = draw(logits, params, n)
    assert (expected[drawn] > 0).all()  # nothing a filter dropped is ever drawn
    seen = torch.bincount(drawn, minlength=len(logits)).double() / n
    # Five standard deviations of a frequency over n independent draws.
    assert ((seen - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12).all(), (seen, expected)


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_top_p_keeps_exactly_the_nucleus_of_a_large_vocabulary(shape):
    # Peaked: the nucleus holds ~1,000 of 50,000 tokens, scattered, more than the first most likely ones looked
    # at. Flat (a random model's logits): it holds most of the vocabulary.
    from pluginhost.engine.sampler import _filter, _top_p

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50_000, generator=generator)
    if shape == "peaked":
        place = torch.randperm(50_000, generator=generator)[:1200]
        logits[place] = 9.0 - torch.arange(1200) / 400
    params = SamplingParams(temperature=0.7, top_p=0.9)
    kept = filtered_by_transformers(logits, params) > 0
    assert (500 < int(kept.sum()) < 1200) if shape == "peaked" else (10_000 < int(kept.sum()) < 45_000)
    row = logits / params.temperature
    _filter(row[None], [params])
    assert torch.equal(row.isfinite(), kept)
    assert kept[draw(logits, params, 256)].all()
    sorted_row = logits / params.temperature  # as on a GPU: the whole vocabulary sorted
    _top_p(sorted_row[None], [params.top_p], first=len(sorted_row))
    assert torch.equal(sorted_row.isfinite(), kept)
    # In a batch, beside rows of other parameters (filtered together), each row keeps what it keeps alone.
    rows = [logits / params.temperature, logits.flip(0), logits, logits.roll(7)]
    settings = [params, SamplingParams(top_p=0.5), SamplingParams(top_k=5), SamplingParams()]
    batch = torch.stack(rows)
    _filter(batch, settings)
    for row, setting, batched in zip(rows, settings, batch, strict=True):
        assert torch.equal(batched, filtered_alone(row, setting))


@pytest.mark.parametrize("rows_at_once", [None, 3])
def test_rows_whose_nucleus_lies_past_the_most_likely_tokens_are_searched_together_each_as_alone(
    rows_at_once, monkeypatch
):
    # Every row of a batch searched at once (a random model's flat logits, 32 rows of a server's step), each with its
    # own top_p: one bin's tokens of every row sorted together must keep each row's own, as transformers does. Some
    # rows have tokens without mass (-inf), one a band of tied tokens at its boundary, one a peaked head, one
    # near-flat logits (a high temperature: its tokens within a hair of each other), one all tied (a processor that
    # flattened it). rows_at_once: the rows searched in groups of 3 (as a large batch of a large vocabulary is).
    from pluginhost.engine import sampler as module
    from pluginhost.engine.sampler import _filter

    V = 50_000
    if rows_at_once:
        monkeypatch.setattr(module, "_SEARCH_NUMBERS", rows_at_once * V)
    generator = torch.Generator().manual_seed(5)
    rows, settings = [], []
    for i, top_p in enumerate([0.9, 0.5, 0.99, 0.3, 0.75, 0.95, 0.6, 0.9, 0.8, 0.4]):
        logits = torch.randn(V, generator=generator) * (0.5 + i / 4)
        if i % 3 == 1:
            logits[torch.randperm(V, generator=generator)[: V // 4]] = float("-inf")
        if i == 3:
            logits[: V // 2] = 0.25  # tied tokens across the boundary
        if i == 6:
            logits[torch.randperm(V, generator=generator)[:200]] += 4.0
        if i == 8:
            logits = torch.randn(V, generator=generator) * 1e-3
        if i == 9:
            logits = torch.zeros(V)
        rows.append(logits)
        settings.append(SamplingParams(temperature=0.8, top_p=top_p))
    batch = torch.stack(rows) / 0.8
    _filter(batch, settings)
    for logits, params, batched in zip(rows, settings, batch, strict=True):
        kept = filtered_by_transformers(logits, params) > 0
        if params.top_p in (0.3, 0.4, 0.8):
            # Tied at the boundary (the near-flat row: in float32 probabilities, as sampling computes them; the
            # reference is in float64): which of them is a matter of order; how many agree within one, and every
            # token kept is at least as likely as every one dropped.
            assert abs(int(batched.isfinite().sum()) - int(kept.sum())) <= 1
            dropped = ~batched.isfinite() & logits.isfinite()
            assert float(logits[batched.isfinite()].min()) >= float(logits[dropped].max()) - 1e-6
        else:
            assert torch.equal(batched.isfinite(), kept), params
        assert 64 < int(kept.sum()) < V  # past the 64 most likely: searched
        # The kept logits unchanged, the others -inf: as filtered alone.
        assert torch.equal(filtered_alone(logits / 0.8, params), batched)


def test_rows_of_different_top_k_and_min_p_in_one_batch_each_keep_their_own():
    # Each filter runs once over the rows asking for it, top_k once for each value: each row keeps what transformers
    # keeps for it, ties with its k-th logit included.
    from pluginhost.engine.sampler import _filter

    generator = torch.Generator().manual_seed(11)
    V = 50_000
    settings = [
        SamplingParams(top_k=3),
        SamplingParams(top_k=40_000),
        SamplingParams(top_k=3, min_p=0.2),
        SamplingParams(top_k=100, top_p=0.5),
        SamplingParams(min_p=0.05),
        SamplingParams(),
    ]
    rows = [torch.randn(V, generator=generator) * 3 for _ in settings]
    rows[0][[7, 70, 700, 7000]] = 20.0  # four tied above the rest: top_k=3 keeps all four, as transformers does
    batch = torch.stack(rows)
    _filter(batch, settings)
    for logits, params, batched in zip(rows, settings, batch, strict=True):
        assert torch.equal(batched.isfinite(), filtered_by_transformers(logits, params) > 0), params
        assert torch.equal(filtered_alone(logits, params), batched)
    assert int(batch[0].isfinite().sum()) == 4


def test_rows_decided_by_their_most_likely_tokens_beside_rows_searched_each_keep_their_own():
    # One batch through both ways: a peaked row (its 64 most likely hold top_p), a flat one (searched), an all-tied
    # one first (its bin taken unsorted, before a row laid out for sorting), and a row of two tied levels whose
    # boundary lies in the lower (its least likely tokens, the lowest bin, are kept).
    from pluginhost.engine.sampler import _filter

    generator = torch.Generator().manual_seed(2)
    V = 50_000
    peaked = torch.randn(V, generator=generator)
    peaked[:10] = 15.0
    levels = torch.zeros(V)
    levels[:500] = 1.0
    rows = [torch.zeros(V), peaked, torch.randn(V, generator=generator), levels]
    settings = [SamplingParams(top_p=0.9) for _ in rows]
    batch = torch.stack(rows)
    _filter(batch, settings)
    for logits, params, batched in zip(rows, settings, batch, strict=True):
        kept = filtered_by_transformers(logits, params) > 0
        assert torch.equal(filtered_alone(logits, params), batched)
        assert abs(int(batched.isfinite().sum()) - int(kept.sum())) <= 1  # ties at the boundary: how many, within one
        assert float(logits.softmax(dim=-1)[batched.isfinite()].sum()) >= params.top_p - 1e-6
    assert torch.equal(batch[1].isfinite(), filtered_by_transformers(peaked, settings[1]) > 0)
    assert torch.equal(batch[2].isfinite(), filtered_by_transformers(rows[2], settings[2]) > 0)
    assert int(batch[3].isfinite().sum()) > 500  # into the lower level


@pytest.mark.parametrize("seed", range(12))
def test_a_row_keeps_token_0_beside_a_row_whose_boundary_holds_more_tokens(seed):
    # Rows searched together are laid out side by side, the shorter padded: the padding never stands for a token (it
    # pointed at token 0 once, which a row then lost from its nucleus in about half of such batches).
    from pluginhost.engine.sampler import _filter

    V = 20_000
    params = SamplingParams(top_p=0.7)
    generator = torch.Generator().manual_seed(seed)
    row = torch.randn(V, generator=generator)
    order = row.argsort(descending=True)
    probs = row.softmax(dim=-1)[order].double()
    inside = int(((probs.cumsum(dim=0) - probs) < 0.7).sum())  # the nucleus's size
    last = int(order[inside - 1 - seed % 3])
    row[[0, last]] = row[[last, 0]]  # token 0 among the last few the nucleus keeps
    flatter = torch.randn(V, generator=generator) * 0.3
    batch = torch.stack([row, flatter])
    _filter(batch, [params, params])
    assert torch.equal(batch[0], filtered_alone(row, params)) and bool(batch[0, 0].isfinite())


@pytest.mark.parametrize("filtered", [{"top_p": 0.9}, {"min_p": 0.1}, {"top_k": 5}, {"top_k": 105, "top_p": 0.9}])
def test_a_token_forced_with_an_infinite_logit_is_drawn_whatever_the_filters(filtered):
    # +inf (a processor's "this token, surely", logit_bias inf): all the mass is there, which every filter keeps. And
    # a top_k above the vocabulary filters nothing.
    from pluginhost.engine.sampler import sample

    V = 100
    params = SamplingParams(temperature=1.0, **filtered)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = float("inf")
    tokens = sample(logits, [state_of(params, i, V) for i in range(3)])
    assert tokens[0] == 7 and all(isinstance(t, int) for t in tokens)


class _Idle:
    """A logits processor that never changes the most likely token (it changes nothing)."""

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True


@pytest.mark.parametrize("processors", [(), (_Idle(),)])
def test_rows_without_a_state_or_greedy_beside_drawn_rows_get_what_they_ask(processors):
    # A row whose sequence waits (state None) and a greedy one beside rows that draw: each drawn row's logits are
    # taken from its own row, with processors or without.
    from pluginhost.engine.sampler import sample

    V = 100
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    logits[3, 42] = 50.0  # this row draws 42 surely

    def state(params, seed):
        return state_of(params, seed, V)

    drawn = SamplingParams(temperature=1.0, top_p=0.9)
    states = [None, state(SamplingParams(temperature=0), 0), state(drawn, 1), state(drawn, 2)]
    tokens = sample(logits, states, processors)
    assert tokens[0] is None and tokens[1] == int(logits[1].argmax()) and tokens[3] == 42
    assert isinstance(tokens[2], int)
    only_drawn = sample(logits[2:], [state(drawn, 1), state(drawn, 2)], processors)
    assert only_drawn == [tokens[2], 42]  # the same stream, the same token, whatever else is in the batch
    assert sample(logits[2:4], [None, state(drawn, 2)], processors) == [None, 42]


def test_a_top_p_next_to_1_over_fewer_than_64_likely_tokens_keeps_them_all(llm):
    # top_k=8 leaves 8 tokens with any mass; top_p 0.99999999 rounds to 1 in float32, so the 64 most likely never
    # "reached" it, and the search took the log of the 64th probability, 0: a ValueError that failed the whole step.
    from pluginhost.engine.sampler import _filter

    row = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.99999999)
    filtered = row.clone()
    _filter(filtered[None], [params])
    assert int(filtered.isfinite().sum()) == 8
    tiny = SamplingParams(temperature=1.0, top_k=8, top_p=0.99999999, seed=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [tiny, greedy(max_tokens=4)])
    assert [len(o.token_ids) for o in outs] == [4, 4]


@pytest.mark.parametrize("levels", [1, 2])
def test_top_p_over_tied_tokens_keeps_as_many_as_transformers(levels):
    # Thousands of tokens of one probability (a processor that flattens a row, a dummy model): the former bisection
    # never narrowed them, and its 64 rounds made top-p 5-6x slower than a sort.
    from pluginhost.engine.sampler import _filter

    logits = torch.zeros(50_000)
    logits[: 20_000 * (levels - 1)] = 1.0  # a second, likelier level, holding more than top_p
    params = SamplingParams(temperature=1.0, top_p=0.3)
    row = logits.clone()
    _filter(row[None], [params])
    kept = row.isfinite()
    # Which of the tied tokens is a matter of order; how many, of rounding at the boundary: one token at most.
    assert abs(int(kept.sum()) - int((filtered_by_transformers(logits, params) > 0).sum())) <= 1
    assert logits[kept].min() == logits.max()


@pytest.mark.parametrize(("tied", "top_p", "kept"), [(2, 0.5, 1), (4, 0.5, 2), (8, 0.25, 2), (1024, 0.5, 512)])
def test_top_p_at_an_exact_boundary_of_tied_tokens_keeps_what_transformers_keeps(tied, top_p, kept):
    # Where the nucleus ends exactly between two equal tokens (a yes/no choice at top_p=0.5), the next one is left out.
    from pluginhost.engine.sampler import _filter

    row = torch.zeros(1, tied)
    _filter(row, [SamplingParams(temperature=1.0, top_p=top_p)])
    reference = filtered_by_transformers(torch.zeros(tied), SamplingParams(temperature=1.0, top_p=top_p))
    assert int(row.isfinite().sum()) == int((reference > 0).sum()) == kept


def test_min_p_1_keeps_only_the_most_likely_token(llm):
    # Accepted by validation (min_p in [0, 1]): every draw is the greedy token, nothing left empty.
    greedy_tokens = llm.generate([PROMPTS[0]], greedy(max_tokens=6))[0].token_ids
    for seed in range(3):
        params = SamplingParams(temperature=1.0, min_p=1.0, seed=seed, max_tokens=6, ignore_eos=True)
        assert llm.generate([PROMPTS[0]], params)[0].token_ids == greedy_tokens


class AlwaysEos(OPTForCausalLM):
    def compute_logits(self, hidden_states):
        logits = torch.full_like(super().compute_logits(hidden_states), -1e9)
        logits[..., 2] = 0.0
        logits[..., 9] = -1.0  # the runner-up, once end-of-sequence is masked
        return logits


def test_min_tokens_holds_back_end_of_sequence_and_stop_tokens(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", AlwaysEos)])
    out = llm.generate([[2, 5]], SamplingParams(temperature=0, max_tokens=10, min_tokens=3))[0]
    assert (out.token_ids, out.finish_reason) == ([9, 9, 9, 2], "stop")
    # Both stop tokens held back for two tokens (the model's next choice is token 0), then end-of-sequence.
    out = llm.generate([[2, 5]], SamplingParams(temperature=0, max_tokens=10, min_tokens=2, stop_token_ids=[9]))[0]
    assert (out.token_ids, out.finish_reason, out.outputs[0].stop_reason) == ([0, 0, 2], "stop", None)
    # With ignore_eos too, as vLLM: end-of-sequence came first, from the first token on ([2, 2, 2, ...]).
    out = llm.generate([[2, 5]], SamplingParams(temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason) == ([9, 9, 9, 2, 2], "length")


def test_min_tokens_with_every_token_a_stop_token_is_refused_not_sampled(llm):
    # Greedy gave token 0, silently; sampled, "no token can be drawn" ended every request of the step.
    everything = SamplingParams(min_tokens=1, max_tokens=3, stop_token_ids=list(range(llm.vocab_size)))
    with pytest.raises(ValueError, match=r"take in all 384 tokens of the vocabulary: min_tokens=1 would leave no"):
        llm.generate([[2, 5]], everything)
    assert llm.generate([[2, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids  # and it serves on


class Sets:
    """A logits processor as ``sample`` takes it: gives ``rows`` of the logits ``value``."""

    def __init__(self, rows: list[int], value: float, *, invariant: bool = False) -> None:
        self.rows, self.value, self.invariant = rows, value, invariant

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows] = self.value
        return logits

    def is_argmax_invariant(self) -> bool:
        return self.invariant


class KeepsOnly(Sets):
    """Leaves every row only ``token``."""

    def __init__(self, token: int) -> None:
        super().__init__([], 0.0)
        self.token = token

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        kept = logits[:, self.token].clone()
        logits[:] = float("-inf")
        logits[:, self.token] = kept
        return logits


def test_rows_the_processors_leave_no_token_are_named_with_the_processor_that_emptied_them():
    # Greedy rows took token 0 (or a NaN's index); drawn rows raised a RuntimeError naming no one, for the batch.
    states = [state_of(greedy()), state_of(greedy()), state_of(greedy()), None]  # row 3 waits this step
    masks, writes_nan, refills = Sets([0, 2, 3], float("-inf")), Sets([1], float("nan")), Sets([2], 0.0)
    with pytest.raises(NoTokenLeft) as caught:
        sampler.sample(torch.randn(4, 8), states, [masks, writes_nan, refills])
    assert caught.value.rows == {0: (masks,), 1: (writes_nan,)}  # row 2 was given a token again; row 3 is idle
    only_eos, idle = KeepsOnly(2), Sets([], 0.0)
    with pytest.raises(NoTokenLeft) as caught:  # end-of-sequence alone was left, which min_tokens masks
        sampler.sample(torch.randn(1, 8), [state_of(greedy(min_tokens=2))], [only_eos, idle])
    assert (caught.value.rows, caught.value.by_min_tokens) == ({0: (only_eos, idle)}, {0})
    drawn = state_of(SamplingParams(temperature=1.0))
    before = drawn.generator.get_state()
    keeps = Sets([0], float("nan"), invariant=True)  # claims to keep the most likely token: applied after temperature
    with pytest.raises(NoTokenLeft) as caught:
        sampler.sample(torch.randn(2, 8), [drawn, state_of(greedy())], [keeps])
    assert caught.value.rows == {0: (keeps,)} and torch.equal(drawn.generator.get_state(), before)  # nothing drawn
    assert sampler.sample(torch.randn(2, 8), [None, state_of(greedy())], [Sets([0], float("nan"))])[0] is None


@pytest.mark.parametrize("vocab", [8, 50272])
def test_greedy_takes_the_first_of_tied_most_likely_tokens_as_argmax_does(vocab):
    # The greedy path takes max(dim=-1).indices (faster than argmax on a CPU): ties must still go to the first index,
    # in a batch of greedy rows only and in one that also draws.
    logits = torch.full((3, vocab), -1.0)
    logits[0, [vocab - 1, 3, vocab // 2]] = 2.0  # tied; the first is 3
    logits[1, vocab - 1] = 5.0  # the last token alone
    logits[2, [0, 1]] = 0.5  # tied at the very start
    expected = logits.argmax(dim=-1).tolist()
    assert expected == [3, vocab - 1, 0]
    assert sampler.sample(logits, [state_of(greedy()) for _ in range(3)]) == expected
    drawn = state_of(SamplingParams(temperature=1.0, top_k=1))
    assert sampler.sample(logits, [state_of(greedy()), drawn, state_of(greedy())]) == expected


# -- logit_bias, allowed_token_ids, bad_words ---------------------------------------------


def test_logit_bias_equals_transformers_sequence_bias(llm, reference):
    plain = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    bias = {plain[0][0]: -4.0, plain[1][2]: -9.5, 77: 3.0, 300: 2.5}
    ours = [o.token_ids for o in llm.generate(PROMPTS, greedy(logit_bias=bias))]
    assert ours == transformers_greedy(reference, sequence_bias={(t,): b for t, b in bias.items()})
    assert ours != plain  # the bias changed something, so the comparison means something


def first_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The model's own log-probabilities (V,) of the token after ``prompt``, from its forward pass."""
    with torch.no_grad():
        logits = llm.model.compute_logits(llm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None]))[0, -1]
    return logits.log_softmax(dim=-1)


def test_a_logit_bias_forces_or_bans_a_token_and_logprobs_stay_the_models(llm):
    plain = llm.generate([PROMPTS[0]], greedy())[0]
    forced = llm.generate([PROMPTS[0]], greedy(logprobs=0, logit_bias={41: 100.0}))[0].outputs[0]
    assert forced.token_ids == [41] * 12
    # vLLM's raw log-probabilities: of the model's own distribution, before the request's bias
    assert forced.logprobs[0][41] == pytest.approx(float(first_logprobs(llm, PROMPTS[0])[41]), abs=1e-5)
    banned = llm.generate([PROMPTS[0]], greedy(logit_bias={t: float("-inf") for t in set(plain.token_ids)}))[0]
    assert not set(banned.token_ids) & set(plain.token_ids)
    # A +inf bias on a token allowed_token_ids leaves out: the mask wins (the other way round, -inf + inf is NaN).
    masked = SamplingParams(max_tokens=4, seed=0, allowed_token_ids=[5, 6], logit_bias={7: float("inf")})
    out = llm.generate([PROMPTS[0]], masked)[0].token_ids
    assert len(out) == 4 and set(out) <= {5, 6}


def test_allowed_token_ids_restrict_every_sample_and_greedy_takes_the_likeliest_of_them(llm):
    allowed = [3, 50, 51, 120, 200]
    sampled = llm.generate(
        PROMPTS, SamplingParams(max_tokens=16, n=3, seed=1, ignore_eos=True, allowed_token_ids=allowed)
    )
    tokens = {t for out in sampled for sample in out.outputs for t in sample.token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1
    chosen = llm.generate([PROMPTS[0]], greedy(max_tokens=1, allowed_token_ids=allowed))[0].token_ids
    logprobs = first_logprobs(llm, PROMPTS[0])
    assert chosen == [max(allowed, key=lambda t: logprobs[t])]
    assert int(logprobs.argmax()) not in allowed  # the restriction changed the choice


def test_bad_words_ban_their_tokens_where_the_output_would_complete_them(demo_llm):
    tokenizer = demo_llm.get_tokenizer()
    prompt = tokenizer("A plugin is")["input_ids"]
    plain = demo_llm.generate([prompt], greedy())[0].token_ids  # ' a plugin is a module with functions ...'
    plugin = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("plugin", " plugin")}  # a token each
    assert plugin & set(plain)
    out = demo_llm.generate([prompt], greedy(bad_words=["plugin"]))[0].token_ids
    assert not plugin & set(out)
    # A word of two tokens is cut where the output would complete it, and only there.
    word = tokenizer.encode(" a module", add_special_tokens=False)
    at = next(i for i in range(len(plain)) if plain[i : i + 2] == word)
    out = demo_llm.generate([prompt], greedy(bad_words=["a module"]))[0].token_ids
    assert out[: at + 1] == plain[: at + 1] and out[at + 1] != plain[at + 1]
    assert all(out[i : i + 2] != word for i in range(len(out) - 1))
    # The prompt's tokens do not count (vLLM's reading): a word the prompt begins is not banned.
    begun = prompt + plain[: at + 1]
    assert demo_llm.generate([begun], greedy(max_tokens=1, bad_words=["a module"]))[0].token_ids == [plain[at + 1]]


def test_token_choices_that_leave_nothing_are_refused_or_end_only_their_request(llm, doubled_token):
    tokenizer = llm.tokenizer
    with pytest.raises(ValueError, match=r"its allowed_token_ids and logit_bias leave no token of the vocabulary"):
        llm.generate([PROMPTS[0]], SamplingParams(allowed_token_ids=[5], logit_bias={5: float("-inf")}))
    with pytest.raises(ValueError, match=r"only tokens that would end it, which min_tokens=2 forbids") as caught:
        llm.generate([PROMPTS[0]], SamplingParams(allowed_token_ids=[2], min_tokens=2))
    assert caught.value.param == "min_tokens"
    with pytest.raises(ValueError, match=r"logit_bias token ids \[384, 999\] outside the vocabulary \[0, 384\)"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={999: 1.0, 384: 1.0, 5: 1.0}))
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids \[400\] outside the vocabulary"):
        llm.generate([PROMPTS[0]], SamplingParams(allowed_token_ids=[5, 400]))
    # Written as a number float32 cannot hold, a bias is -inf too (greedy gave token 0 for ever).
    with pytest.raises(ValueError, match=r"its logit_bias leaves no token of the vocabulary to choose"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias=dict.fromkeys(range(384), -1e100)))
    # Known only once the output begins a bad word: the sample that has nothing left ends with the error.
    a = doubled_token(tokenizer)
    stuck = SamplingParams(max_tokens=5, allowed_token_ids=[a], bad_words=[tokenizer.decode([a, a])], ignore_eos=True)
    with pytest.raises(
        ValueError,
        match=r"this request's allowed_token_ids and bad_words left no token to choose after 1 generated tokens",
    ) as caught:
        llm.generate([PROMPTS[0]], stuck)
    assert caught.value.param == "allowed_token_ids"
    assert llm.generate([PROMPTS[1]], greedy(max_tokens=3))[0].token_ids  # and it serves on


def test_a_request_its_own_choices_empty_while_recomputed_ends_alone(llm, doubled_token):
    # Recomputed after a preemption (as when the cache cannot grow), it is prefilled beside a request that decodes:
    # the sampler's row counted the step's active rows only, and the engine ended the other request in its place.
    tokenizer = llm.tokenizer
    a = doubled_token(tokenizer)
    innocent = llm._inputs.make_request("innocent", PROMPTS[1], greedy(max_tokens=20))
    llm.engine.submit([innocent])
    llm.engine.step()
    words = {"allowed_token_ids": [a, 2], "bad_words": [tokenizer.decode([a, a])], "min_tokens": 3}
    stuck = llm._inputs.make_request("stuck", PROMPTS[0], SamplingParams(max_tokens=5, **words))
    llm.engine.submit([stuck])
    while not stuck.sequences[0].token_ids:
        llm.engine.step()
    llm.engine.scheduler.preempt(stuck.sequences[0])
    llm.engine.run_until(lambda: innocent.finished and stuck.finished)
    assert innocent.error is None and len(innocent.sequences[0].token_ids) == 20
    assert isinstance(stuck.error, ValueError)
    assert "min_tokens=3 holds back the tokens that would end it, left no token" in str(stuck.error)


def test_a_row_its_own_choices_and_min_tokens_empty_is_the_requests_fault_not_a_processors():
    # With a processor at work, the row was blamed on it (a PluginHookError, a server's 500) though it changed nothing.
    choices = TokenChoices(allowed=torch.tensor([2, 5]), sequences={5: ((5, 5),)}, may_empty=True)
    own = SamplingState(
        greedy(min_tokens=3), torch.Generator(), [2], frozenset({2}), 8, torch.device("cpu"), choices=choices
    )
    own.record(5)  # the output ends with the bad word's first token: 5 is banned, end-of-sequence held back
    idle = Sets([], 0.0)
    with pytest.raises(NoTokenLeft) as caught:
        sampler.sample(torch.randn(2, 8), [own, state_of(greedy())], [idle])
    assert (caught.value.rows, caught.value.by_request, caught.value.by_min_tokens) == ({0: ()}, {0}, {0})
    own.record(3)  # the word is no longer begun: 5 is choosable again
    assert sampler.sample(torch.randn(1, 8), [own], [idle]) == [5]


def test_bad_words_need_a_tokenizer(tiny_opt_no_tokenizer):
    llm = LLM(str(tiny_opt_no_tokenizer), load_installed_plugins=False)
    with pytest.raises(ValueError, match="asks for bad_words, but .* has no tokenizer .* use logit_bias with a -inf"):
        llm.generate([[2, 5]], SamplingParams(bad_words=["x"]))
    assert llm.generate([[2, 5]], SamplingParams(max_tokens=2, logit_bias={5: float("-inf")}))[0].token_ids


# -- stop strings -------------------------------------------------------------------------


#: Writes ``Scripted.script`` (set by the ``scripted`` fixture) whatever the weights say.
Scripted = scripted_opt([])


TEXT = "The quick brown fox jumps over the lazy dog. Hello world!"


@pytest.fixture(scope="module")
def scripted(tiny_opt) -> LLM:
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", Scripted)])
    Scripted.script = [2, *llm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]]
    return llm


def test_a_scripted_model_writes_its_text(scripted):
    out = scripted.generate([[2]], greedy(max_tokens=len(Scripted.script) - 1))[0]
    assert out.text == TEXT


@pytest.mark.parametrize(
    ("stop", "included", "held"), [([], False, 0), (["none of it"], False, 9), (["none"], True, 0)]
)
def test_a_stream_holds_back_only_what_may_begin_a_stop_string(scripted, stop, included, held):
    """Each streamed text is every character of its tokens but the last ``len(longest stop) - 1`` (a stop string
    may yet begin there): with none, nothing is held, and a stream lagged no character behind its tokens; nor when
    the stop string stays in the text (include_stop_str_in_output, as vLLM holds nothing back then)."""
    seen: list = []
    params = greedy(max_tokens=len(Scripted.script) - 1, stop=stop, include_stop_str_in_output=included)
    request = scripted._inputs.make_request(
        "stream", [2], params, on_output=lambda output, error: seen.append(output), streaming=True
    )
    scripted.engine.submit([request])
    while not request.finished:
        scripted.engine.step()
    *running, final = (output.outputs[0] for output in seen)
    assert len(running) >= 3 and final.text == TEXT
    for sample in running:
        whole = scripted.tokenizer.decode(sample.token_ids)
        assert sample.text == whole[: max(0, len(whole) - held)]


def test_stop_strings_cut_the_text_across_token_boundaries(scripted):
    ids = Scripted.script[1:]
    pieces = [scripted.tokenizer.decode([t]) for t in ids]
    assert "".join(pieces) == TEXT and len(ids) < len(TEXT)  # several characters per token here
    # A stop string from inside one token to inside a later one.
    k = next(i for i in range(2, len(pieces)) if len(pieces[i]) >= 2 and len(pieces[i + 2]) >= 2)
    start = len("".join(pieces[:k])) + 1
    end = len("".join(pieces[: k + 2])) + 1
    stop = TEXT[start:end]
    assert TEXT.index(stop) == start

    out = scripted.generate([[2]], greedy(max_tokens=40, stop=stop))[0].outputs[0]
    assert out.text == TEXT[:start]  # the stop string is not part of the text
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == ids[: k + 3]  # generation ended with the token that completed it
    # vLLM's include_stop_str_in_output: up to its end (not the rest of the token that completed it).
    kept = scripted.generate([[2]], greedy(max_tokens=40, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert (kept.text, kept.stop_reason, kept.token_ids) == (TEXT[:end], stop, out.token_ids)
    # A stop token id's text too (vLLM decodes it then), where it is no special token.
    stop_id = ids[k]
    by_id = greedy(max_tokens=40, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    kept = scripted.generate([[2]], by_id)[0].outputs[0]
    assert (kept.text, kept.stop_reason) == ("".join(pieces[: k + 1]), stop_id)
    assert scripted.generate([[2]], by_id.clone(include_stop_str_in_output=False))[0].text == "".join(pieces[:k])


def test_several_stop_strings_end_at_the_earliest(scripted):
    out = scripted.generate([[2]], greedy(max_tokens=40, stop=["lazy", "fox", "never \u2603"]))[0]
    assert out.text == "The quick brown " and out.outputs[0].stop_reason == "fox"
    out = scripted.generate([[2]], greedy(max_tokens=40, stop=["o"]))[0]  # the first "o", inside "brown"
    assert out.text == "The quick br"
    # One token completing two (" quick" holds "qui" and "ui"): the one earlier in the text, whichever is listed first.
    out = scripted.generate([[2]], greedy(max_tokens=40, stop=["ui", "qui"]))[0]
    assert out.text == "The " and out.outputs[0].stop_reason == "qui"
    # Kept in the text, the one that ends first: "m" inside "umps" (the text held a whole "m" and went on).
    out = scripted.generate([[2]], greedy(max_tokens=40, stop=["umps", "m"], include_stop_str_in_output=True))[0]
    assert out.text == "The quick brown fox jum" and out.outputs[0].stop_reason == "m"


def test_a_stop_token_whose_text_completes_a_stop_string_stops_there_when_it_is_kept(scripted):
    # include_stop_str_in_output decodes the stop token (as vLLM): a stop string it completes is the reason, and
    # the text ends after that string (it kept the token's whole text, the token id the reason).
    pieces = [scripted.tokenizer.decode([t]) for t in Scripted.script[1:]]
    at = next(i for i, piece in enumerate(pieces) if len(piece.strip()) >= 3)  # a token of three characters or more
    word = pieces[at].strip()
    params = greedy(max_tokens=40, stop=[word[:2]], stop_token_ids=[Scripted.script[1 + at]])
    out = scripted.generate([[2]], params.clone(include_stop_str_in_output=True))[0].outputs[0]
    before = "".join(pieces[:at]) + pieces[at][: pieces[at].index(word)]
    assert (out.text, out.stop_reason) == (before + word[:2], word[:2])
    out = scripted.generate([[2]], params)[0].outputs[0]  # not kept: the token id ended it, its text left out
    assert (out.text, out.stop_reason) == ("".join(pieces[:at]), Scripted.script[1 + at])


def test_stop_strings_wait_for_min_tokens(scripted):
    out = scripted.generate([[2]], greedy(max_tokens=40, stop="The", min_tokens=3))[0]
    assert out.text == TEXT  # "The" was complete before the third token, so nothing stopped it
    # Only once more than min_tokens are out, as end-of-sequence and stop ids (vLLM's rule): min_tokens=1 is how
    # a caller asks for an answer that is not empty, and the first token completing a stop string gave one.
    out = scripted.generate([[2]], greedy(max_tokens=40, stop="The", min_tokens=1))[0]
    assert out.text == TEXT  # the first "The" kept; the script's next one stopped it (the text was empty)
    out = scripted.generate([[2]], greedy(max_tokens=40, stop=["The", "o"], min_tokens=3))[0]
    assert out.outputs[0].stop_reason == "o" and len(out.token_ids) >= 3


def test_skip_special_tokens_false_keeps_their_text_but_not_a_stop_tokens(llm):
    forced = greedy(max_tokens=3, logit_bias={2: 100.0})  # end-of-sequence three times, ignored
    eos = llm.tokenizer.convert_ids_to_tokens(2)
    assert llm.generate([PROMPTS[0]], forced)[0].text == ""
    for spaces in (True, False):  # no space between them either way, as vLLM's detokenizer for fast tokenizers
        kept = forced.clone(skip_special_tokens=False, spaces_between_special_tokens=spaces)  # lm-eval sends False
        assert llm.generate([PROMPTS[0]], kept)[0].text == eos * 3
    ended = forced.clone(ignore_eos=False, skip_special_tokens=False)  # as vLLM: the token that ends it is not text
    assert llm.generate([PROMPTS[0]], ended)[0].outputs[0].text == ""
    assert llm.generate([PROMPTS[0]], ended.clone(include_stop_str_in_output=True))[0].text == eos


def test_stop_strings_need_a_tokenizer(tiny_opt_no_tokenizer):
    llm = LLM(str(tiny_opt_no_tokenizer), load_installed_plugins=False)
    with pytest.raises(ValueError, match="asks for stop strings, but .* has no tokenizer"):
        llm.generate([[2, 5]], SamplingParams(stop="x"))
    assert llm.generate([[2, 5]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("text", ["héllo wörld", "snow \u2603 and \U0001f389 party", "日本語のテキスト"])
def test_incremental_text_never_shows_half_characters(llm, text):
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # multi-byte characters are split over several tokens here
    detokenizer = IncrementalDetokenizer(llm.tokenizer, [2])
    seen = []
    for token in ids:
        detokenizer.push(token)
        seen.append(detokenizer.text)
        assert "\ufffd" not in detokenizer.text
    detokenizer.flush()
    assert detokenizer.text == text and seen[-1] == text


@pytest.mark.parametrize("kind", ["byte-level", "byte fallback"])
def test_a_character_cut_short_by_the_end_is_left_out_not_shown_as_half(llm, kind):
    tokenizer = llm.tokenizer if kind == "byte-level" else byte_fallback_tokenizer()
    ids = tokenizer("a snow \u2603", add_special_tokens=False)["input_ids"]  # the snowman: 3 bytes, 3 tokens
    assert len(ids) >= 4 and tokenizer.decode(ids).endswith("\u2603")
    for cut in (1, 2):  # max_tokens ends the text one or two bytes short of the snowman
        for last in ([], [tokenizer.eos_token_id]):  # or an end-of-sequence token (ignore_eos), which decodes to ""
            detokenizer = IncrementalDetokenizer(tokenizer, [1])
            for token in ids[:-cut] + last:
                detokenizer.push(token)
            detokenizer.flush()
            assert detokenizer.text.rstrip() == tokenizer.decode(ids[:-3]).rstrip()  # U+FFFD was once per byte


@pytest.mark.parametrize("kind", ["byte-level", "byte fallback"])
def test_a_prompt_ending_inside_a_character_loses_no_generated_text(llm, kind):
    # An answer cut off inside a character, sent back as ids to go on: with byte fallback each byte of the
    # prompt's tail decoded to a U+FFFD, and the finished character took the place of that many generated ones.
    tokenizer = llm.tokenizer if kind == "byte-level" else byte_fallback_tokenizer()
    ids = tokenizer("a snow \u2603 a snow", add_special_tokens=False)["input_ids"]
    start = next(i for i, t in enumerate(ids) if "\ufffd" in tokenizer.decode([t]))  # the snowman's first byte
    for cut in (1, 2):  # the prompt ends one or two bytes into the snowman
        detokenizer = IncrementalDetokenizer(tokenizer, ids[: start + cut])
        for token in ids[start + cut :]:
            detokenizer.push(token)
        detokenizer.flush()
        assert detokenizer.text == "\u2603 a snow"  # the character the prompt began, then every generated one


@pytest.mark.parametrize("kind", ["byte-level", "byte fallback"])
@pytest.mark.parametrize(
    ("prompt", "answer"), [("a snow \U0001f642\U0001f642", "\U0001f642 a snow"), ("日本", "語のテキスト")]
)
def test_a_prompt_whose_last_tokens_begin_inside_a_character_loses_no_generated_text(llm, kind, prompt, answer):
    # The context window (the prompt's last tokens) began inside the first emoji: byte fallback decoded the whole
    # run of byte tokens after it to U+FFFDs, and every generated byte of the run with them ('\ufffd' * 4 + ' a snow').
    tokenizer = llm.tokenizer if kind == "byte-level" else byte_fallback_tokenizer()
    ids = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    cut = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(ids[:cut]) == prompt and tokenizer.decode(ids[cut:]) == answer
    detokenizer = IncrementalDetokenizer(tokenizer, [1, *ids[:cut]])
    for token in ids[cut:]:
        detokenizer.push(token)
    detokenizer.flush()
    assert detokenizer.text == answer
    if kind == "byte fallback":  # a context of nothing but a character's last byte (ids cut, sent back): kept,
        tail = ids[cut - 1]  # or the first word lost its space ('a snow' for ' a snow')
        assert 0x80 <= token_bytes(tokenizer, tail)[0] < 0xC0
        words = tokenizer("a snow", add_special_tokens=False)["input_ids"]  # '▁', 'a', '▁', 's', ...
        detokenizer = IncrementalDetokenizer(tokenizer, [1, tail])
        for token in words:
            detokenizer.push(token)
        detokenizer.flush()
        assert detokenizer.text == " a snow"


@pytest.mark.parametrize("kind", ["byte-level", "byte fallback"])
def test_a_run_of_special_tokens_is_not_decoded_again_at_every_token(llm, kind):
    # End-of-sequence generated again and again (ignore_eos): each token decoded the whole run before it again, in
    # the loop every request shares (4,000 of them: 1.6 ms a token, growing).
    tokenizer = llm.tokenizer if kind == "byte-level" else byte_fallback_tokenizer()
    word = tokenizer(" snow", add_special_tokens=False)["input_ids"]

    def text_of(ids: list[int], windows: list[int]) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, [1])
        decode = detokenizer._decode
        detokenizer._decode = lambda window: windows.append(len(window)) or decode(window)
        for token in ids:
            detokenizer.push(token)
        detokenizer.flush()
        return detokenizer.text

    windows: list[int] = []
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id
    assert text_of(word + [eos] * 300 + word + [pad] * 300 + word, windows) == text_of(word * 3, [])
    assert max(windows) <= 16  # the window decoded stays a few tokens long, whatever came before


# -- n samples ----------------------------------------------------------------------------


def test_n_samples_are_independent_streams_from_one_seed(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPTS[0]], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert [o.token_ids for o in llm.generate([PROMPTS[0]], params)[0].outputs] == [o.token_ids for o in out.outputs]
    for i, sample in enumerate(out.outputs):  # sample i is what seed + i gives alone
        alone = llm.generate([PROMPTS[0]], params.clone(n=1, seed=11 + i))[0]
        assert alone.token_ids == sample.token_ids
        assert sample.cumulative_logprob == pytest.approx(
            sum(s[t] for s, t in zip(sample.logprobs, sample.token_ids, strict=True))
        )
    assert (out.text, out.token_ids, out.finish_reason) == (
        out.outputs[0].text,
        out.outputs[0].token_ids,
        out.outputs[0].finish_reason,
    )


def test_unseeded_samples_are_reproducible_from_the_engine_seed(tiny_opt):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    runs = [
        [
            o.token_ids
            for o in LLM(str(tiny_opt), load_installed_plugins=False, seed=5).generate(PROMPTS[:1], params)[0].outputs
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1


def test_seed_minus_one_means_no_seed_as_in_vllm(llm):
    """Clients send ``"seed": -1`` for "random": it was a fixed seed, and every such request wrote the same text."""
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=8, ignore_eos=True)
    assert params.seed is None
    texts = {tuple(llm.generate([PROMPTS[0]], params)[0].token_ids) for _ in range(4)}
    assert len(texts) > 1


def test_vllm_fields_at_their_defaults_are_taken_and_at_other_values_refused_naming_them(llm):
    """A port passes vLLM's fields at their defaults: a bare TypeError (unexpected keyword) even for those."""
    ported = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        n=2,
        best_of=2,
        prompt_logprobs=None,
        detokenize=True,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        include_stop_str_in_output=False,
        truncate_prompt_tokens=None,
        structured_outputs=None,
    )
    assert ported.detokenize is True and "spaces_between_special_tokens" not in repr(ported)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=2)
    assert llm.generate([PROMPTS[0]], ported)[0].outputs == llm.generate([PROMPTS[0]], plain)[0].outputs
    for name, value in [
        ("best_of", 3),
        ("spaces_between_special_tokens", 1),
        ("structured_outputs", {}),
    ]:
        with pytest.raises(ValueError, match=rf"SamplingParams: {name}=.* is not supported by pluginhost") as caught:
            SamplingParams(**{name: value})
        assert caught.value.param == name
    with pytest.raises(ValueError, match="include_stop_str_in_output must be True or False, got 1"):
        plain.clone(include_stop_str_in_output=1)


def test_numpy_numbers_are_taken_as_python_numbers(llm):
    params = SamplingParams(
        temperature=np.float32(0.0), top_k=np.int64(5), max_tokens=np.int64(4), stop_token_ids=[np.int64(3)]
    )
    assert (type(params.temperature), type(params.top_k), type(params.max_tokens)) == (float, int, int)
    assert params.stop_token_ids == [3] and type(params.stop_token_ids[0]) is int
    greedy = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, top_k=5, max_tokens=4, stop_token_ids=[3]))
    assert llm.generate([PROMPTS[0]], params)[0].token_ids == greedy[0].token_ids


# -- bad values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an integer >= 1"),
        ({"stop": [""]}, "stop must be a non-empty string or a list of them"),
        ({"stop": 5}, "stop must be"),
        ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens \(20\) must be at most max_tokens \(10\)"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"extra_args": ["a"]}, "extra_args must be a dict or None"),
        ({"temperature": 10**400}, "temperature must be >= 0 and finite"),  # no float holds it: was an OverflowError
        ({"top_k": np.float64(2.5)}, "top_k must be an integer"),
        ({"allowed_token_ids": []}, r"allowed_token_ids is empty: it would allow no token \(None allows every token\)"),
        ({"allowed_token_ids": [3, -1]}, r"allowed_token_ids must be a list of token ids >= 0, got \[3, -1\]"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias values must be numbers \(-inf bans a token\), got nan"),
        ({"logit_bias": {"5": 1.0}}, r"logit_bias must map token ids \(integers >= 0\) to numbers, got \{'5': 1.0\}"),
        ({"bad_words": ["ok", "  "]}, r"bad_words must be a list of words \(non-blank strings\)"),
        ({"bad_words": ["w"] * 1025}, r"bad_words may hold at most 1024 words .* got 1025"),
    ],
)
def test_bad_values_are_one_clear_value_error_and_the_engine_stays_usable(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    params.n = kwargs.get("n", 2)  # a value changed after construction is checked when the request arrives
    if params.n == 0:
        with pytest.raises(ValueError, match="n must be"):
            llm.generate([PROMPTS[0]], params)
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_misspelt_field_set_after_construction_is_an_error_not_ignored():
    params = SamplingParams(temperature=0)
    with pytest.raises(AttributeError, match="max_token"):
        params.max_token = 40  # type: ignore[attr-defined]  # max_tokens meant: 16 tokens would be generated
    params.max_tokens = 40  # the fields themselves stay assignable
    assert params.clone().max_tokens == 40


def test_each_requests_extra_args_are_its_own_all_the_way_down():
    shared = SamplingParams(extra_args={"tags": ["site"]})
    mine = shared.clone()
    mine.extra_args["tags"].append("mine")  # an on_request hook adding to one request's list
    assert shared.extra_args == {"tags": ["site"]} and mine.extra_args == {"tags": ["site", "mine"]}
