"""AsyncLLM and continuous batching: streaming, joining mid-flight, aborts, a free event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from builtin_models.opt import OPTForCausalLM
from pluginhost import LLM, AsyncLLM, SamplingParams, hookimpl
from pluginhost.errors import ModelRunError
from pluginhost.testing import RegistersModel
from pluginhost.testing.server import wait_until

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42], [2, 9, 9]]
TIMEOUT = 60


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def engine(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_opt) -> LLM:
    return LLM(str(tiny_opt), load_installed_plugins=False)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT))


async def collect(engine: AsyncLLM, prompt, params, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_streamed_outputs_are_cumulative_and_end_as_offline(engine, offline):
    outs = run(collect(engine, PROMPTS[0], greedy(12), "stream"))
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    for earlier, later in zip(outs, outs[1:], strict=False):
        assert later.outputs[0].token_ids[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
    alone = offline.generate([PROMPTS[0]], greedy(12))[0]
    assert outs[-1].outputs[0].token_ids == alone.token_ids and outs[-1].outputs[0].text == alone.text


def test_vllms_output_kinds_delta_and_final_only(engine):
    """vLLM's ``output_kind``: DELTA outputs add up to the cumulative ones (text, tokens, logprobs; the prompt's
    logprobs once), FINAL_ONLY yields the finished output alone."""
    from pluginhost.sampling import RequestOutputKind

    params = SamplingParams(max_tokens=12, n=2, seed=4, temperature=1.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    whole = run(collect(engine, PROMPTS[0], params, "cumulative"))[-1]
    deltas = run(collect(engine, PROMPTS[0], params.clone(output_kind=RequestOutputKind.DELTA), "delta"))
    assert len(deltas) > 1 and deltas[-1].finished
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert deltas[0].prompt_logprobs == whole.prompt_logprobs
    for sample in whole.outputs:
        parts = [d.outputs[sample.index] for d in deltas]
        assert "".join(p.text for p in parts) == sample.text
        assert sum((p.token_ids for p in parts), []) == sample.token_ids
        assert sum((p.logprobs for p in parts), []) == sample.logprobs and parts[-1].finish_reason == "length"
    final = run(collect(engine, PROMPTS[0], params.clone(output_kind=RequestOutputKind.FINAL_ONLY), "final"))
    assert len(final) == 1 and final[0].outputs == whole.outputs
    with pytest.raises(ValueError, match=r"output_kind must be a RequestOutputKind .* got 3"):
        params.clone(output_kind=3)
    assert params.clone(output_kind=np.int64(1)).output_kind is RequestOutputKind.DELTA  # NumPy's, as Python's


class Retitles:
    """Changes a finished request's text where the stream had already sent it."""

    @hookimpl
    def on_output(self, request, output):
        for sample in output.outputs:
            sample.text = "<" + sample.text[3:]


def test_delta_outputs_go_on_after_text_an_on_output_hook_changed_as_the_servers_streams(tiny_opt):
    """What was yielded cannot be taken back: the last delta is what follows it in the changed text (the tail of
    the old length cut from the new text came out garbled)."""
    from pluginhost.outputs import text_after
    from pluginhost.sampling import RequestOutputKind

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Retitles()])
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        final = run(collect(engine, PROMPTS[0], params, "cumulative"))[-1].outputs[0].text
        deltas = run(collect(engine, PROMPTS[0], params.clone(output_kind=RequestOutputKind.DELTA), "delta"))
    finally:
        engine.shutdown()
    sent = "".join(d.outputs[0].text for d in deltas[:-1])
    assert not final.startswith(sent) and deltas[-1].outputs[0].text == text_after(sent, final, "delta")


def test_a_request_joining_mid_flight_gets_what_it_would_get_alone(engine, offline):
    """Greedy output does not depend on the batch: joining while others run changes nothing."""

    async def scenario():
        decoding = asyncio.Event()

        async def long():
            outs = []
            async for out in engine.generate(PROMPTS[0], greedy(100), "long"):
                outs.append(out)
                if len(out.outputs[0].token_ids) >= 5:
                    decoding.set()
            return outs

        first = asyncio.create_task(long())
        await decoding.wait()  # the long one is decoding: the others join a running batch
        others = [collect(engine, p, greedy(10 + 3 * i), f"join-{i}") for i, p in enumerate(PROMPTS[1:])]
        results = await asyncio.gather(*others)
        assert not first.done()  # they ran beside it, start to end
        return [await first, *results]

    results = run(scenario())
    params = [greedy(100)] + [greedy(10 + 3 * i) for i in range(3)]
    for prompt, p, outs in zip(PROMPTS, params, results, strict=True):
        alone = offline.generate([prompt], p)[0]
        assert outs[-1].outputs[0].token_ids == alone.token_ids
        for a, b in zip(outs[-1].outputs[0].logprobs, alone.logprobs, strict=True):
            assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-4


def test_a_short_request_sent_while_a_long_one_runs_finishes_first(engine):
    async def scenario():
        finished = []

        async def timed(name, prompt, n):
            await collect(engine, prompt, greedy(n), name)
            finished.append(name)

        long = asyncio.create_task(timed("long", PROMPTS[0], 100))
        while engine.engine.scheduler.num_running == 0:
            await asyncio.sleep(0.001)
        await timed("short", PROMPTS[1], 3)
        await long
        return finished

    assert run(scenario()) == ["short", "long"]


def test_abort_ends_the_stream_and_frees_the_row(engine):
    async def scenario():
        seen = []
        async for out in engine.generate(PROMPTS[2], greedy(100), "to-abort"):
            seen.append(out)
            if len(out.outputs[0].token_ids) >= 3 and not out.finished:
                engine.abort("to-abort")
        return seen

    seen = run(scenario())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 100
    assert wait_until(lambda: engine.engine.scheduler.num_running == 0)


def test_abort_takes_one_id_or_an_iterable_of_them_as_vllm_does(engine):
    # vLLM's abort(request_id: str | Iterable[str]): a list raised "unhashable type", a tuple aborted nothing.
    async def scenario():
        streams = [await engine.submit(PROMPTS[i], greedy(200), f"many-{i}") for i in range(3)]
        engine.abort(["many-0", "many-1"])
        await engine.abort(("many-2",))  # vLLM's abort is a coroutine: ported code awaits it (a TypeError)
        await asyncio.create_task(engine.abort("many-2"))  # or runs it as a task
        with pytest.raises(TypeError, match="a request id \\(str\\) or an iterable of them, got 5"):
            engine.abort(5)
        return [[out async for out in stream][-1].outputs[0].finish_reason for stream in streams]

    assert run(scenario()) == ["abort"] * 3


@pytest.mark.parametrize("request_id", [5, b"r"])
def test_a_request_id_abort_could_not_name_is_refused_and_an_empty_one_kept(engine, request_id):
    # An int id was taken (abort(5) then a TypeError, the request ran to its end); "" became "asyncllm-0".
    async def scenario():
        with pytest.raises(TypeError, match="request_id must be a str \\(or None for one the engine picks\\), got"):
            await engine.submit(PROMPTS[0], greedy(200), request_id)
        stream = await engine.submit(PROMPTS[0], greedy(200), "")
        engine.abort("")
        return [out async for out in stream][-1]

    last = run(scenario())
    assert (last.request_id, last.outputs[0].finish_reason) == ("", "abort")


def test_leaving_the_stream_early_aborts_the_request(engine):
    async def scenario():
        async for out in engine.generate(PROMPTS[3], greedy(100), "left"):
            if len(out.outputs[0].token_ids) >= 2:
                break  # a client that went away

    run(scenario())
    assert wait_until(lambda: engine.engine.scheduler.num_running == 0 and not engine.engine.has_work())


class Slow(OPTForCausalLM):
    """Every forward pass takes 20 ms more, as a big model's would."""

    def forward(self, *args, **kwargs):
        time.sleep(0.02)
        return super().forward(*args, **kwargs)


def test_model_work_never_blocks_the_event_loop(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", Slow)])

    async def scenario():
        gaps, last = [], time.perf_counter()
        stream = asyncio.create_task(collect(engine, PROMPTS[0], greedy(25), "busy"))
        while not stream.done():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        await stream
        return gaps

    try:
        gaps = run(scenario())
    finally:
        engine.shutdown()
    # 25 forward passes of 20 ms or more: had they run on the event loop, no tick would be shorter.
    assert len(gaps) > 50 and sorted(gaps)[len(gaps) // 2] < 0.015


class RecordsThreads(OPTForCausalLM):
    """Notes the thread of every piece of model work: its construction, weight loading, forward passes."""

    threads: set[int] = set()

    def __init__(self, config):
        RecordsThreads.threads.add(threading.get_ident())
        super().__init__(config)

    def load_weights(self, weights):
        RecordsThreads.threads.add(threading.get_ident())
        return super().load_weights(weights)

    def forward(self, *args, **kwargs):
        RecordsThreads.threads.add(threading.get_ident())
        return super().forward(*args, **kwargs)


def test_one_thread_builds_and_runs_the_model_and_it_is_not_the_callers(tiny_opt):
    """torch's OpenMP runtime slows every parallel region once two threads run them: one thread does it all."""
    RecordsThreads.threads.clear()
    engine = AsyncLLM(
        str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", RecordsThreads)]
    )
    try:
        built_on = set(RecordsThreads.threads)
        assert run(collect(engine, PROMPTS[0], greedy(3), "threads"))[-1].finished
    finally:
        engine.shutdown()
    assert len(built_on) == 1 and RecordsThreads.threads == built_on
    assert threading.get_ident() not in built_on


def test_a_build_failure_is_raised_by_the_constructor_as_llm_raises_it(tiny_opt):
    class Broken(OPTForCausalLM):
        def load_weights(self, weights):
            raise RuntimeError("weights on fire")

    plugins = [RegistersModel("OPTForCausalLM", Broken)]
    with pytest.raises(Exception, match="weights on fire") as offline:
        LLM(str(tiny_opt), load_installed_plugins=False, plugins=plugins)
    before = set(threading.enumerate())
    with pytest.raises(type(offline.value), match="weights on fire"):
        AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=plugins)
    assert wait_until(lambda: not set(threading.enumerate()) - before, timeout=5), "the failed build left its thread"


class SlowToLoad(OPTForCausalLM):
    def load_weights(self, weights):
        time.sleep(1.0)
        return super().load_weights(weights)


def test_a_build_the_caller_stopped_waiting_for_ends_its_engine(tiny_opt):
    """Ctrl-C while AsyncLLM builds: the constructor raises it at once, and the build, once done, stops."""
    before = set(threading.enumerate())
    main = threading.main_thread().ident
    threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()  # Ctrl-C, as the main thread gets it
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", SlowToLoad)])
    assert time.monotonic() - started < 1.0  # did not wait for the build
    assert wait_until(lambda: not set(threading.enumerate()) - before, timeout=30), "the engine kept running"


def test_an_engine_built_while_its_module_is_imported_builds_and_serves(tiny_opt, tmp_path):
    """``uvicorn app:app``: the app's module builds the engine at import, with a model from that very module."""
    (tmp_path / "app_module.py").write_text(
        textwrap.dedent(f"""
            import asyncio
            from builtin_models.opt import OPTForCausalLM
            from pluginhost import AsyncLLM, SamplingParams
            from pluginhost.testing import RegistersModel

            class AppModel(OPTForCausalLM):
                pass

            engine = AsyncLLM(
                {str(tiny_opt)!r},
                load_installed_plugins=False,
                plugins=[RegistersModel("OPTForCausalLM", "app_module:AppModel")],
            )
        """)
    )
    script = textwrap.dedent("""
        import asyncio
        import app_module
        from pluginhost import SamplingParams

        async def main():
            async for out in app_module.engine.generate([2, 5, 9], SamplingParams(max_tokens=3), "r"):
                pass
            print(type(app_module.engine.model).__name__, len(out.outputs[0].token_ids))

        asyncio.run(main())
        app_module.engine.shutdown()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AppModel", "3"]


def test_bad_requests_raise_and_the_engine_keeps_serving(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(collect(engine, [2, 10**6], greedy(2), "bad"))
    with pytest.raises(ValueError, match="top_p must be in"):
        run(collect(engine, PROMPTS[0], SamplingParams(top_p=2.0), "bad-2"))
    assert run(collect(engine, PROMPTS[1], greedy(2), "after"))[-1].finished


def test_a_model_failure_reaches_the_stream_and_later_requests_are_served(tiny_opt, flaky_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[flaky_opt()])
    try:
        with pytest.raises(ModelRunError, match="Flaky .* failed while generating: RuntimeError: kernel fault"):
            run(collect(engine, PROMPTS[0], greedy(4), "fails"))
        assert len(run(collect(engine, PROMPTS[0], greedy(4), "works"))[-1].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()


def test_streamed_text_never_shows_half_a_character(tiny_opt):
    """A byte-level model emitting the bytes of multi-byte characters: every streamed text is whole."""
    text = "héllo 🎉 wörld"

    class Spells(OPTForCausalLM):
        script: list[int] = []

        def forward(self, input_ids, positions, *args, **kwargs):
            hidden = super().forward(input_ids, positions, *args, **kwargs)
            return positions[..., None].to(hidden.dtype).expand(hidden.shape).contiguous()

        def compute_logits(self, hidden_states):
            following = (hidden_states[..., 0].long() + 1) % len(self.script)
            logits = torch.full((*hidden_states.shape[:-1], self.config.vocab_size), -1e9)
            return logits.scatter_(-1, torch.tensor(self.script)[following][..., None], 0.0)

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", Spells)])
    try:
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        Spells.script = [2, *ids]
        outs = run(collect(engine, [2], SamplingParams(max_tokens=len(ids), temperature=0, ignore_eos=True), "t"))
        assert all("\ufffd" not in o.outputs[0].text for o in outs)
        assert outs[-1].outputs[0].text == text
        assert len({o.outputs[0].text for o in outs}) < len(outs)  # some steps waited for a character's rest
    finally:
        engine.shutdown()


def test_a_streamed_output_is_the_callers_to_change_the_request_runs_on_as_given(tiny_opt, offline):
    # The outputs held the request's live prompt list and its logprob dicts: a client that built its next
    # prompt from one (history.extend) changed the running request's prompt, and what a preemption recomputes.
    seen: list[list[int]] = []

    class Spy:
        @hookimpl
        def on_output(self, request, output):
            seen.append(list(request.prompt_token_ids))

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Spy()])

    async def scenario():
        outs = []
        async for out in engine.generate(PROMPTS[3], greedy(6), "changed"):
            if not outs:
                history = out.prompt_token_ids  # a client building its next prompt
                history.extend([99, 99])
                with pytest.raises(TypeError, match="logprobs are read-only"):
                    out.outputs[0].logprobs[0].clear()  # or tidying what it shows
                tidied = dict(out.outputs[0].logprobs[0])  # a copy is its to change
                tidied.clear()
            outs.append(out)
        return outs

    try:
        outs = run(scenario())
    finally:
        engine.shutdown()
    alone = offline.generate([PROMPTS[3]], greedy(6))[0]
    assert outs[0].prompt_token_ids == [*PROMPTS[3], 99, 99]  # the caller's own copy
    assert seen == [PROMPTS[3]] and outs[-1].prompt_token_ids == PROMPTS[3]
    assert outs[-1].token_ids == alone.token_ids and outs[-1].logprobs == alone.logprobs


def test_a_request_id_in_use_is_refused_at_once_and_the_running_request_is_untouched(engine, offline):
    async def scenario():
        first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="request id\\(s\\) 'dup' already running"):
            engine.add_request(PROMPTS[1], greedy(3), "dup")
        engine.abort("dup")  # the id is free at once: abort, then the same id again, in that order
        again = [out async for out in engine.generate(PROMPTS[1], greedy(3), "dup")]
        rest = [out async for out in first]
        return rest, again

    rest, again = run(scenario())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 40
    assert again[-1].outputs[0].token_ids == offline.generate([PROMPTS[1]], greedy(3))[0].token_ids


def test_an_id_the_engine_picks_never_collides_with_one_a_caller_picked(engine):
    async def scenario():
        name, number = engine._new_request_id().rsplit("-", 1)
        picked = f"{name}-{int(number) + 1}"  # the id the engine would give next
        mine = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), picked)
        await mine.__anext__()
        auto = engine.add_request(PROMPTS[1], greedy(2))  # must not take the caller's running id
        ids = (mine.request_id, auto.request_id)
        engine.abort(picked)
        [out async for out in auto], [out async for out in mine]
        return ids

    mine, auto = run(scenario())
    assert auto != mine


def test_a_prompt_is_tokenized_and_checked_beside_the_event_loop_not_in_it(tiny_opt, offline):
    # A prompt of megabytes takes seconds to tokenize: in the loop, every other stream and /health waited.
    threads = []

    class Where:
        @hookimpl
        def on_request(self, request):  # runs where the request is prepared, after tokenizing
            threads.append(threading.current_thread())

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Where()])
    try:

        async def scenario():
            outs = await collect(engine, [2, 5, 6], greedy(3), "ids")
            with pytest.raises(ValueError, match="prompt 0 has token id"):  # errors are add_request's
                await engine.submit([2, 10**6], greedy(3))
            return threading.current_thread(), outs

        loop_thread, outs = run(scenario())
    finally:
        engine.shutdown()
    assert len(threads) == 1 and threads[0] is not loop_thread and threads[0].name.startswith("pluginhost-inputs")
    assert outs[-1].outputs[0].token_ids == offline.generate([[2, 5, 6]], greedy(3))[0].token_ids


def test_a_request_arrives_when_its_caller_says_not_when_it_is_prepared(engine):
    """A server passes the time its HTTP request came in: latencies count the wait to be tokenized."""

    async def scenario():
        came_in = time.monotonic() - 5.0  # as if it had waited 5 s for the input thread
        given = await engine.submit([2, 5], greedy(2), arrival_time=came_in)
        made = await engine.submit([2, 6], greedy(2))
        both = await engine.submit_all([([2, 7], greedy(2), None), ([2, 8], greedy(2), None)], arrival_time=came_in)
        for stream in (given, made, *both):
            [out async for out in stream]
        return came_in, given.request, made.request, [s.request for s in both]

    came_in, given, made, both = run(scenario())
    assert given.arrival_time == came_in and [r.arrival_time for r in both] == [came_in] * 2
    assert made.arrival_time > came_in  # unsaid: when it was made
    assert given.first_token_time - given.arrival_time >= 5.0  # what a time-to-first-token metric then reads


class HeldInPreparation:
    """A plugin whose on_request waits, in the input thread, until the test lets the request go on."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.ids: list[str] = []

    @hookimpl
    def on_request(self, request):
        self.ids.append(request.request_id)
        if len(self.ids) == 2:  # the second prompt of a request
            self.reached.set()
            assert self.go.wait(TIMEOUT)

    async def reach(self) -> None:
        await asyncio.to_thread(self.reached.wait, TIMEOUT)


@pytest.fixture
def held(tiny_opt):
    plugin = HeldInPreparation()
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin])
    yield engine, plugin
    plugin.go.set()
    engine.shutdown()


def test_a_caller_cancelled_while_its_prompts_are_prepared_leaves_nothing_queued(held):
    # A client that left while its second prompt was prepared kept its first one generating to the end.
    engine, plugin = held

    async def scenario():
        task = asyncio.create_task(engine.submit_all([([2, 5], greedy(40), "a"), ([2, 6], greedy(40), "b")]))
        await plugin.reach()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        plugin.go.set()
        await asyncio.sleep(0.2)  # the input thread finishes preparing what nobody waits for
        return engine.engine.is_running("a") or engine.engine.is_running("b")

    assert run(scenario()) is False and not engine.engine.scheduler.has_work()


def test_an_id_the_engine_picked_is_picked_again_if_a_caller_took_it_during_preparation(held, offline):
    engine, plugin = held

    async def scenario():
        first = await engine.submit([2, 7], greedy(2))  # on_request's first call: not held
        picked = asyncio.create_task(engine.submit([2, 5], greedy(3)))  # held: its id is in plugin.ids
        await plugin.reach()
        theirs = engine.add_request([2, 6], greedy(3), plugin.ids[-1])  # a caller takes that id meanwhile
        plugin.go.set()
        mine = await picked
        outs = [[o async for o in stream][-1] for stream in (first, mine, theirs)]
        return mine.request_id, theirs.request_id, outs

    mine, theirs, outs = run(scenario())
    assert mine != theirs
    assert [o.outputs[0].token_ids for o in outs[1:]] == [
        offline.generate([p], greedy(3))[0].token_ids for p in ([2, 5], [2, 6])
    ]


def test_a_program_ending_without_shutdown_while_a_request_runs_exits_cleanly():
    # The loop thread was mid-step when the interpreter went: torch's C++ aborted the process (exit status 134).
    script = textwrap.dedent("""
        import asyncio
        from pluginhost import AsyncLLM, SamplingParams
        from pluginhost.demo import ensure_demo_model

        engine = AsyncLLM(str(ensure_demo_model()), load_installed_plugins=False)

        async def main():
            stream = engine.add_request([2, 7, 8], SamplingParams(max_tokens=250, temperature=0, ignore_eos=True))
            await stream.__anext__()  # the request runs on; the program ends without engine.shutdown()

        asyncio.run(main())
        print("ended")
    """)
    for _ in range(3):  # it aborted four times in five
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, "ended"), done.stderr[-2000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_an_engine_used_in_a_forked_child_says_to_build_one_there(tiny_opt):
    # A child forked after the build (multiprocessing's default on Linux, gunicorn --preload) has the engine without
    # its threads: AsyncLLM's request waited for ever, LLM's first product hung in torch's thread pool.
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        from pluginhost import LLM, AsyncLLM, SamplingParams
        params = SamplingParams(max_tokens=2)
        llm = LLM({str(tiny_opt)!r}, load_installed_plugins=False)
        engine = AsyncLLM({str(tiny_opt)!r}, load_installed_plugins=False)

        async def stream():
            async for _ in engine.generate([2, 7], params, "r"):
                pass

        pid = os.fork()
        if pid == 0:
            for use in (lambda: llm.generate([[2, 7]], params, use_tqdm=False), lambda: asyncio.run(stream())):
                try:
                    use()
                    print("generated", flush=True)
                except RuntimeError as exc:
                    print(str(exc).split(":")[0], flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print(len(llm.generate([[2, 7]], params, use_tqdm=False)[0].outputs[0].token_ids), flush=True)
        engine.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 3, done.stdout + done.stderr[-2000:]
    assert all(line.startswith("this engine was built in process") for line in lines[:2]) and lines[2] == "2"


def test_an_engine_dropped_without_shutdown_is_freed_and_its_streams_end(tiny_opt):
    # The loop thread and an atexit entry held the AsyncLLM: dropped, its model stayed in memory and its thread
    # polled for ever (one more per engine a program made), and a stream still open never ended.
    async def scenario():
        engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False)
        freed = weakref.ref(engine)
        model = weakref.ref(engine.model)
        stream = await engine.submit([2, 5, 9], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        await stream.__anext__()  # it runs
        loop_thread = engine._loop.thread
        del engine
        gc.collect()
        outs = [out async for out in stream]
        return freed(), outs[-1].outputs[0].finish_reason if outs else None, loop_thread, model

    alive, reason, loop_thread, model = run(scenario())
    assert alive is None and reason == "abort"
    loop_thread.join(TIMEOUT)
    gc.collect()
    assert not loop_thread.is_alive() and model() is None


def test_requests_waiting_to_be_prepared_at_shutdown_are_told_it_was_shut_down_not_cancelled(held):
    # Dropped from the input thread's queue, they raised CancelledError, which callers read as their own cancel.
    engine, plugin = held

    async def scenario():
        first = asyncio.create_task(engine.submit_all([([2, 5], greedy(2), "a1"), ([2, 6], greedy(2), "a2")]))
        await plugin.reach()  # a2 is being prepared
        queued = asyncio.create_task(engine.submit([2, 7], greedy(2)))  # behind it
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(asyncio.to_thread(engine.shutdown, 5))
        await asyncio.sleep(0.2)
        plugin.go.set()
        results = await asyncio.gather(first, queued, return_exceptions=True)
        await stopping
        return results

    for result in run(scenario()):
        assert isinstance(result, RuntimeError) and "shut down" in str(result)


def test_shutdown_returns_within_its_timeout_while_a_plugin_holds_the_engine_in_a_step(tiny_opt):
    # shutdown() waited for the step without end: a program ending with a hook stuck (a lost rank) never exited.
    entered, release = threading.Event(), threading.Event()

    class Stuck:
        @hookimpl
        def on_output(self, request, output):
            entered.set()
            release.wait(TIMEOUT)

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Stuck()])
    try:
        run(engine.submit([2, 5], greedy(1)))
        assert entered.wait(TIMEOUT)  # the loop thread is inside the step, in the hook
        start = time.monotonic()
        engine.shutdown(timeout=1)
        took = time.monotonic() - start
    finally:
        release.set()
    assert took < 1.8  # one deadline for all of shutdown: it waited its timeout for the step, then for the thread


def test_every_stream_ends_when_shutdown_is_called_while_they_stream(tiny_opt):
    # The loop thread handed a step's outputs out after releasing the engine: shutdown's own step handed the aborts
    # out first, then a stale unfinished output took their place and 30 of 32 streams never ended.
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

    async def consume(engine, i):
        return [out async for out in engine.generate([2, 5 + i, 9], params, f"r{i}")][-1].outputs[0].finish_reason

    async def scenario(engine):
        tasks = [asyncio.create_task(consume(engine, i)) for i in range(32)]
        await asyncio.sleep(0.3)  # they stream
        engine.shutdown()  # from the event loop, as a program's finally: does
        done, pending = await asyncio.wait(tasks, timeout=10)
        for task in pending:
            task.cancel()
        return len(pending), {task.result() for task in done}

    for _ in range(3):
        engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=32)
        assert run(scenario(engine)) == (0, {"abort"})


def test_every_stream_ends_when_a_step_outlasts_shutdowns_timeout(tiny_opt):
    # shutdown(timeout) returned in time, then the loop thread finished its long step and left without handing out
    # the aborts shutdown had queued: every stream waited for ever.
    slow_now = threading.Event()

    class SlowOnce:
        @hookimpl
        def post_load(self, config, model):
            def hook(module, args, output):
                if slow_now.is_set():
                    slow_now.clear()
                    time.sleep(1.5)

            model.register_forward_hook(hook)

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[SlowOnce()])

    async def last_reason(stream):
        return [out async for out in stream][-1].outputs[0].finish_reason

    async def scenario():
        # The first step (their prefill) is the long one: on a fast machine a later one came after all had finished.
        slow_now.set()
        streams = [await engine.submit(PROMPTS[i], greedy(200)) for i in range(3)]
        tasks = [asyncio.create_task(last_reason(stream)) for stream in streams]
        assert await asyncio.to_thread(wait_until, lambda: not slow_now.is_set())  # the loop is in the long step
        engine.shutdown(timeout=0.3)
        done, pending = await asyncio.wait(tasks, timeout=10)
        for task in pending:
            task.cancel()
        return len(pending), [task.result() for task in done]

    assert run(scenario()) == (0, ["abort"] * 3)


def test_a_request_submitted_as_shutdown_begins_is_refused_not_taken_and_left_running(tiny_opt):
    # Submitted between shutdown's aborts and the loop's end, it was taken, began, and its stream never ended.
    class Slow:
        @hookimpl
        def post_load(self, config, model):
            model.register_forward_hook(lambda module, args, output: time.sleep(0.3))

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Slow()])

    async def scenario():
        first = await engine.submit([2, 5, 6], greedy(50), "first")
        await asyncio.sleep(0.5)  # it runs, 0.3 s a step
        stopping = asyncio.create_task(asyncio.to_thread(engine.shutdown, 5))  # another thread: a signal handler
        await asyncio.sleep(0.05)  # shutdown has aborted everything and waits for the step under way
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.submit([2, 7, 8], greedy(50), "late")
        await stopping
        return [out async for out in first][-1].outputs[0].finish_reason

    assert run(scenario()) == "abort"


def test_an_abort_while_the_prompt_is_prepared_is_not_lost(engine):
    # The id was unknown to the engine until the request was queued: the abort found nothing, and it ran to its end.
    async def scenario():
        task = asyncio.create_task(collect(engine, [2, 5, 6], greedy(100), "aborted-early"))
        await asyncio.sleep(0)  # generate() has begun: the prompt is in the input thread
        engine.abort("aborted-early")
        return (await task)[-1].outputs[0]

    out = run(scenario())
    assert out.finish_reason == "abort" and len(out.token_ids) < 100


def test_a_plugin_calling_sys_exit_in_a_step_ends_that_steps_requests_and_the_engine_serves_on(tiny_opt):
    # SystemExit is no Exception: it ended the engine's thread silently, and every stream, then and later, hung.
    class ExitsInForward:
        calls = 0

        @hookimpl
        def post_load(self, config, model):
            def hook(module, args, output):
                ExitsInForward.calls += 1
                if ExitsInForward.calls == 3:
                    sys.exit(1)

            model.register_forward_hook(hook)

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExitsInForward()])
    try:
        with pytest.raises(ModelRunError, match=r"plugin 'ExitsInForward' .* SystemExit: 1"):
            run(collect(engine, [2, 5, 6], greedy(20), "a"))
        assert run(collect(engine, [2, 5, 6], greedy(20), "b"))[-1].outputs[0].finish_reason == "length"
    finally:
        engine.shutdown()


def test_a_stream_read_late_holds_only_its_latest_output_and_ends_at_its_last(engine):
    """Outputs are cumulative: one that is not read yet is replaced by the next, and nothing replaces the last."""

    async def scenario():
        stream = await engine.submit([2, 5, 6], greedy(30), "read-late")
        while not stream.request.finished:
            await asyncio.sleep(0.01)  # the client does not read meanwhile
        await asyncio.sleep(0.05)  # every output has been handed over
        held = stream._latest
        last = held[0]
        stale = dataclasses.replace(last, outputs=[dataclasses.replace(last.outputs[0], finish_reason=None)])
        stream._keep(stale, None)  # an output coming after the last is never shown
        return held, [out async for out in stream]

    held, outs = run(scenario())
    assert held is not None and len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 30
