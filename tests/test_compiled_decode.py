"""The compiled decoding step (``compile_decode``): same outputs as eager decoding, and a clean fallback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from pluginhost import LLM, SamplingParams
from pluginhost.engine.compiled import padded_rows
from pluginhost.errors import ConfigError
from pluginhost.testing import make_tiny_model

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300, 4], [2, 7, 7, 7, 150, 42, 8], [2, 9], [2, 50, 51, 52]]


@pytest.fixture
def cpp_compiler() -> None:
    """Skip where inductor finds no C++ compiler: compiling would fall back (as other tests here check)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - any reason it cannot find one
        pytest.skip(f"torch.compile on a CPU needs a C++ compiler: {exc}")


def engine(path, **settings) -> LLM:
    return LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu", **settings)


def compiled_llm(path, **settings) -> LLM:
    return engine(path, compile_decode=True, **settings)


def test_rows_are_padded_to_few_buckets():
    assert [padded_rows(b, 32) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 25, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 32, 32]
    assert padded_rows(5, 6) == 6  # never beyond the cache's rows
    assert padded_rows(3, 3) == 3


@pytest.mark.parametrize("model_type", ["opt", "llama"])
@pytest.mark.parametrize("forced_kernel", ["f_linear", "onednn"], indirect=True)  # the operator's two paths
def test_compiled_decoding_matches_transformers_at_every_step(
    tmp_path, tiny_opt, model_type, forced_kernel, assert_decoding_matches, cpp_compiler
):
    path = tiny_opt if model_type == "opt" else make_tiny_model(tmp_path, "llama", seed=1)
    llm = compiled_llm(path)
    # Different lengths: rows finish one by one, so the batch shrinks through several padded sizes.
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=3, ignore_eos=True) for n in (9, 3, 7, 1, 5)]
    outs = llm.generate(PROMPTS, params)
    compiled = llm.engine.runner.compiled
    assert compiled.failure is None and compiled.compile_seconds > 0
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    assert_decoding_matches(outs, PROMPTS, reference)


def assert_same_decoding(outs, eager) -> None:
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    for ours, theirs in zip(outs, eager, strict=True):
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-4


def test_compiled_and_eager_decoding_give_the_same_tokens_as_requests_come_and_go(tiny_opt, cpp_compiler):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    eager = engine(tiny_opt).generate(PROMPTS, params)
    llm = compiled_llm(tiny_opt, max_num_seqs=3)  # five requests through three rows: they join as others leave
    assert_same_decoding(llm.generate(PROMPTS, params), eager)
    assert llm.engine.runner.compiled.failure is None


def test_a_bfloat16_kv_cache_compiles_and_decodes_as_eagerly(tmp_path, cpp_compiler):
    # Grouped-query Llama: the compiled step folds the query heads and attends in bfloat16 over the cache.
    path = make_tiny_model(tmp_path, "llama", seed=1)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    eager = engine(path, kv_cache_dtype="bfloat16").generate(PROMPTS, params)
    llm = compiled_llm(path, kv_cache_dtype="bfloat16")
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    for ours, theirs in zip(outs, eager, strict=True):  # bfloat16 sums, fused or not, round apart
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert max(abs(a[t] - b[t]) for t in a) <= 2e-2
    runner = llm.engine.runner
    assert runner.compiled.failure is None and runner.compiled._shapes
    assert {c.k.dtype for c in runner._caches} == {torch.bfloat16}


def test_a_growing_cache_compiles_each_of_its_few_shapes(tmp_path, cpp_compiler):
    path = make_tiny_model(tmp_path, "mistral", seed=1, max_position_embeddings=1100)  # a sliding window, too
    prompts = [[2, 5, 6], [2, *range(10, 260)]]  # the second passes 256 and then 512 slots while decoding
    params = SamplingParams(max_tokens=340, temperature=0, ignore_eos=True, logprobs=1)
    eager = engine(path, max_num_seqs=12)
    eager_outs = eager.generate(prompts, params)
    assert eager.engine.runner.cache_shape == (8, 768)  # eagerly: rows in eights, slots in steps of 256
    llm = compiled_llm(path, max_num_seqs=12)
    assert_same_decoding(llm.generate(prompts, params), eager_outs)
    runner = llm.engine.runner
    assert runner.cache_shape == (12, 1024)  # compiled: every row at once, slots doubling
    assert runner.compiled.failure is None
    assert runner.compiled._shapes == {(2, 12, 256), (2, 12, 512), (2, 12, 1024)}


def test_more_shapes_than_dynamo_keeps_fall_back_to_eager_decoding(tiny_opt, monkeypatch, caplog, cpp_compiler):
    import pluginhost.engine.compiled

    # The step's code is shared by every engine of the process: a limit of 1 is reached at the latest
    # at this engine's second shape (the batch shrinks from 5 rows to 1). A cache of 7 rows, which no
    # other test here uses, makes every shape new even after other tests compiled theirs.
    monkeypatch.setattr(pluginhost.engine.compiled, "_RECOMPILE_LIMIT", 1)
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True) for n in (9, 3, 7, 1, 5)]
    eager = engine(tiny_opt).generate(PROMPTS, params)
    llm = compiled_llm(tiny_opt, max_num_seqs=7)
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        assert_same_decoding(llm.generate(PROMPTS, params), eager)
    assert "RecompileLimitHit" in type(llm.engine.runner.compiled.failure).__name__
    assert sum("compiling the decoding step" in r.getMessage() for r in caplog.records) == 1


def test_the_transformers_fallback_compiles_its_decoding_step(tiny_opt, cpp_compiler):
    # Dynamo failed on the head's moment with the decoder's forward swapped: every fallback model decoded eagerly.
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    eager = engine(tiny_opt, model_impl="transformers").generate(PROMPTS, params)
    llm = compiled_llm(tiny_opt, model_impl="transformers")
    assert_same_decoding(llm.generate(PROMPTS, params), eager)
    assert llm.engine.runner.compiled.failure is None and llm.engine.runner.compiled._shapes


def test_compile_decode_on_a_model_without_a_cache_says_it_does_nothing(tiny_opt, caplog):
    from builtin_models.opt import OPTForCausalLM
    from pluginhost.testing import RegistersModel

    class NoCache(OPTForCausalLM):
        setup_caches = None

    plugin = RegistersModel("OPTForCausalLM", NoCache)
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin], compile_decode=True)
    assert llm.engine.runner.compiled is None
    assert "compile_decode has no effect on NoCache: it has no KV cache" in caplog.text
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("when", ["at its first step", "at torch.compile"])
def test_a_failure_to_compile_falls_back_to_eager_decoding_with_one_warning(tiny_opt, monkeypatch, caplog, when):
    # torch.compile itself refuses on some Pythons (3.15+, free-threaded builds): that was a bare traceback.
    def no_compiler(fn, **options):
        def compiled(*args):
            raise RuntimeError("Compiler: cc not found\nmore detail")

        if when == "at torch.compile":
            compiled()
        return compiled

    monkeypatch.setattr(torch, "compile", no_compiler)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = engine(tiny_opt).generate(PROMPTS, params)
    llm = compiled_llm(tiny_opt)
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        outs = llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS[:1], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    assert again[0].outputs[0].token_ids == eager[0].outputs[0].token_ids
    warnings = [r.getMessage() for r in caplog.records if "compiling the decoding step" in r.getMessage()]
    assert warnings == [
        "compiling the decoding step of OPTForCausalLM failed (RuntimeError: Compiler: cc not found); "
        "decoding without compiling from now on"
    ]


def test_a_model_failing_after_compiling_is_not_hidden_by_the_fallback(tiny_opt, monkeypatch):
    from pluginhost.errors import ModelRunError

    calls = []

    def flaky_compile(fn, **options):
        def compiled(ids, positions, mask):
            calls.append(ids.shape)
            if len(calls) > 1:  # the same shape again: an id beyond the vocabulary, so the model's code raises
                ids = ids + 10**6
            return fn(ids, positions, mask)

        return compiled

    monkeypatch.setattr(torch, "compile", flaky_compile)
    llm = compiled_llm(tiny_opt)
    with pytest.raises(ModelRunError, match="failed while generating: IndexError"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert llm.engine.runner.compiled.failure is None  # a failure of the model, not of compiling


def test_compiling_with_tensor_parallelism_is_refused_before_anything_starts(tiny_opt):
    with pytest.raises(ConfigError, match="compile_decode cannot be combined with tensor parallelism"):
        compiled_llm(tiny_opt, tensor_parallel_size=2)


def test_the_cli_passes_compile_decode(tiny_opt, run_pluginhost):
    result = run_pluginhost("config", "--model", str(tiny_opt), "--compile-decode", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["config"]["compile_decode"] is True and data["provenance"]["compile_decode"] == "user"


def test_a_model_failing_at_its_first_compiled_step_is_the_models_failure(tiny_opt, monkeypatch):
    from pluginhost.engine.compiled import CompiledDecode

    def broken_compiler(fn, **options):
        def compiled(*args):
            raise RuntimeError("the compiled step failed")

        return compiled

    def eager(tokens, positions):
        raise IndexError("index out of range in self")  # the model fails eagerly too

    monkeypatch.setattr(torch, "compile", broken_compiler)
    step = CompiledDecode(torch.nn.Linear(2, 2), torch.device("cpu"), eager)
    with pytest.raises(IndexError, match="out of range"):
        step.logits([5], [3], cache_rows=4, cache_slots=256)
    assert step.failure is None  # the next step tries compiling again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphs_decode_what_eager_cuda_decoding_does(tiny_opt):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    settings = {"load_installed_plugins": False, "dtype": "float32", "device": "cuda"}
    eager = LLM(str(tiny_opt), **settings).generate(PROMPTS, params)
    llm = LLM(str(tiny_opt), compile_decode=True, max_num_seqs=3, **settings)  # replayed graphs as rows come and go
    assert_same_decoding(llm.generate(PROMPTS, params), eager)
    assert llm.engine.runner.compiled.failure is None


def test_rope_following_each_rows_length_compiles_once_for_every_length(tmp_path, cpp_compiler):
    # The frequencies came from the lengths read on the host: a graph break, and a new graph for new lengths.
    import torch._dynamo

    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    path = make_tiny_model(tmp_path, "llama", seed=2, max_position_embeddings=16, rope_parameters=rope)
    compiled, eager = compiled_llm(path), engine(path)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = [[2, *range(10, 20)], [2, 5]]  # 11 and 2 tokens: one row past 16 positions while decoding
    tokens = lambda llm, prompts: [o.token_ids for o in llm.generate(prompts, params)]  # noqa: E731
    assert tokens(compiled, first) == tokens(eager, first)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    other = [[2, *range(30, 44)], [2, 9, 9]]  # other lengths, on both sides of 16
    assert tokens(compiled, other) == tokens(eager, other)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled.engine.runner.compiled.failure is None


def test_a_program_ending_while_the_decoding_step_compiles_exits_with_its_own_status(tiny_opt, cpp_compiler, tmp_path):
    # The exit's shutdown gave up on the engine's thread after its timeout, mid-compile: torch's C++ aborted the
    # process as the interpreter ended under it (status 134).
    script = f"""
import asyncio
import pluginhost.engine.async_llm as async_llm
async_llm._SHUTDOWN_TIMEOUT_S = 0.1  # shorter than any compile
from pluginhost import AsyncLLM, SamplingParams

async def main():
    llm = AsyncLLM({str(tiny_opt)!r}, load_installed_plugins=False, dtype="float32", compile_decode=True)
    stream = await llm.submit([2, 5, 6], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), "r")
    await stream.__anext__()  # the prefill's token: the engine's thread now compiles the decoding step
    await asyncio.sleep(0.5)
    return llm

held = asyncio.run(main())  # the program ends holding it, without shutdown()
"""
    # Nothing compiled yet: seconds to compile. No kernel calibration: a step measuring kernels outlasts 0.1 s too.
    fresh = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PLUGINHOST_KERNEL_CALIBRATION": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=fresh, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
