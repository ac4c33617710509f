"""Runtime hooks: logits processors, on_request, on_output, record_stats, register_routes.

Each hook's normal use and its fault policy: a plugin's failure ends only
what it touched, names the plugin, and the engine (and server) keep serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re

import httpx
import openai
import pytest
import torch

from pluginhost import LLM, AsyncLLM, SamplingParams, hookimpl
from pluginhost.errors import PluginHookError, RequestRefusedError
from pluginhost.logits_processors import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)
from pluginhost.server.app import build_app
from pluginhost.testing.server import metric, running_server

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42], [2, 9, 9]]
TIMEOUT = 60


def greedy(n: int = 6, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kwargs)


# -- a processor written the vLLM v1 way ----------------------------------------------------------


class TargetToken(LogitsProcessor):
    """Per request, ``extra_args={"target_token": t}`` makes every generated token ``t``.

    Written against vLLM v1's interface, as a vLLM plugin would be: only the
    import of ``LogitsProcessor``, ``BatchUpdate`` and ``MoveDirectionality``
    is pluginhost's.
    """

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be an int, got {target!r}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is not None:
                self.targets[index] = target
            else:
                self.targets.pop(index, None)
        for index in batch_update.removed:
            self.targets.pop(index, None)
        for a, b, direction in batch_update.moved:
            target_a, target_b = self.targets.pop(a, None), self.targets.pop(b, None)
            if target_a is not None:
                self.targets[b] = target_a
            if direction == MoveDirectionality.SWAP and target_b is not None:
                self.targets[a] = target_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets), dtype=torch.long)
        columns = torch.tensor(list(self.targets.values()), dtype=torch.long)
        keep = logits[rows, columns].clone()
        logits[rows] = float("-inf")
        logits[rows, columns] = keep
        return logits


class TargetTokens:
    @hookimpl
    def register_logits_processors(self, registry):
        registry.add(TargetToken)


class AddsProcessors:
    """A plugin whose ``register_logits_processors`` adds the given processor classes."""

    def __init__(self, *processors: type[LogitsProcessor]) -> None:
        self.processors = processors

    @hookimpl
    def register_logits_processors(self, registry):
        for processor in self.processors:
            registry.add(processor)


class ForceToken:
    """vLLM's per-request form (examples/offline_inference/logits_processor/custom_req.py): one callable a request."""

    def __init__(self, target: int) -> None:
        self.target = target

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        kept = logits[self.target].item()
        logits[:] = float("-inf")
        logits[self.target] = kept
        return logits


class WrappedTargetToken(AdapterLogitsProcessor):
    """The same behaviour as ``TargetToken`` through vLLM's adapter: only the imports are pluginhost's."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        return ForceToken(target) if target is not None else None


class WrappedTargetTokens:
    @hookimpl
    def register_logits_processors(self, registry):
        registry.add(WrappedTargetToken)


def test_a_request_function_runs_once_per_token_its_request_gets(tiny_opt):
    """As in vLLM: not on the steps its row waits through while newcomers are prefilled."""
    calls: list[tuple[str, int]] = []

    class Counts:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, output_ids, logits):
            calls.append((self.name, len(output_ids)))
            return logits

    class Adapter(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            return Counts(params.extra_args["name"])

    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[AddsProcessors(Adapter)])
    first = llm._inputs.make_request("first", PROMPTS[0], greedy(6, extra_args={"name": "first"}))
    llm.engine.submit([first])
    llm.engine.step(), llm.engine.step()  # prefilled, then one decoding step
    second = llm._inputs.make_request("second", PROMPTS[1], greedy(3, extra_args={"name": "second"}))
    llm.engine.submit([second])  # its prefill step leaves the first waiting
    while not (first.finished and second.finished):
        llm.engine.step()
    assert [n for name, n in calls if name == "first"] == list(range(6))  # once per token, each seeing those before
    assert [n for name, n in calls if name == "second"] == list(range(3))


def test_process_dict_updates_follows_adds_removals_moves_and_swaps():
    state = {0: "a", 1: "b", 2: "c"}
    params = SamplingParams(extra_args={"tag": "new"})
    update = BatchUpdate(
        4,
        added=[(1, params, [2], []), (3, SamplingParams(), [2], [])],  # row 1 reused; row 3 without state
        removed=[2],
        moved=[(0, 3, MoveDirectionality.UNIDIRECTIONAL)],
    )
    assert process_dict_updates(state, update, lambda p, prompt, out: (p.extra_args or {}).get("tag"))
    assert state == {1: "new", 3: "a"}
    swap = BatchUpdate(4, moved=[(1, 3, MoveDirectionality.SWAP)])
    assert process_dict_updates(state, swap, lambda *_: None) and state == {3: "new", 1: "a"}
    assert not process_dict_updates(state, None, lambda *_: None)


def test_a_vllm_v1_processor_forces_tokens_per_request(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[TargetTokens()])
    plain = LLM(str(tiny_opt), load_installed_plugins=False)
    params = [greedy(extra_args={"target_token": 5}), greedy(), greedy(extra_args={"target_token": 77}), greedy()]
    outs = llm.generate(PROMPTS, params)
    assert outs[0].token_ids == [5] * 6 and outs[2].token_ids == [77] * 6
    assert [outs[1].token_ids, outs[3].token_ids] == [
        o.token_ids for o in plain.generate([PROMPTS[1], PROMPTS[3]], greedy())
    ]


@pytest.mark.parametrize("plugin", [TargetTokens, WrappedTargetTokens])
def test_processor_state_follows_the_batch_as_requests_join_leave_and_move(tiny_opt, plugin):
    """Staggered requests of many lengths: rows are filled, freed and compacted; every tag stays its request's."""
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin()], max_num_seqs=6)
    rng = random.Random(0)
    jobs = [(i, rng.choice(PROMPTS), rng.randint(1, 20), rng.choice([None, 10 + i])) for i in range(24)]

    async def one(i, prompt, n, target):
        await asyncio.sleep(rng.random() * 0.05)
        extra = {"target_token": target} if target is not None else None
        return [o async for o in engine.generate(prompt, greedy(n, extra_args=extra), f"job-{i}")][-1]

    async def everyone():
        return await asyncio.gather(*(one(*job) for job in jobs))

    try:
        finals = asyncio.run(asyncio.wait_for(everyone(), TIMEOUT))
    finally:
        engine.shutdown()
    plain = LLM(str(tiny_opt), load_installed_plugins=False)
    for (_, prompt, n, target), out in zip(jobs, finals, strict=True):
        expected = [target] * n if target is not None else plain.generate([prompt], greedy(n))[0].token_ids
        assert out.outputs[0].token_ids == expected


class SeesIdleRows(LogitsProcessor):
    """Records, in every step that prefills newcomers, the rows of the others (which get no token then)."""

    idle_rows: list[torch.Tensor] = []

    def __init__(self, config, device):
        self.running: set[int] = set()
        self.joined: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        self.joined = set()
        if batch_update:
            self.joined = {row for row, *_ in batch_update.added}
            self.running = (self.running | self.joined) - set(batch_update.removed)
            for source, target, _ in batch_update.moved:
                self.running = (self.running - {source}) | {target}

    def apply(self, logits):
        if self.joined:
            SeesIdleRows.idle_rows += [logits[row].clone() for row in self.running - self.joined]
        return logits


def test_rows_waiting_while_newcomers_are_prefilled_hold_zeros_in_apply(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[AddsProcessors(SeesIdleRows)])

    async def staggered():
        async def one(i: int, started: asyncio.Event | None, running: asyncio.Event):
            if started is not None:
                await started.wait()  # the one before decodes: this one's prefill step leaves it idle
            async for _ in engine.generate(PROMPTS[i % 4], greedy(100), f"r{i}"):
                running.set()

        events = [asyncio.Event() for _ in range(4)]
        await asyncio.gather(*(one(i, events[i - 1] if i else None, events[i]) for i in range(4)))

    SeesIdleRows.idle_rows = []
    try:
        asyncio.run(asyncio.wait_for(staggered(), TIMEOUT))
    finally:
        engine.shutdown()
    assert SeesIdleRows.idle_rows, "no step prefilled a newcomer while others ran: the test saw nothing"
    assert all(torch.equal(row, torch.zeros_like(row)) for row in SeesIdleRows.idle_rows)


def test_validate_params_refuses_a_request_naming_the_plugin(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[TargetTokens()])
    with pytest.raises(RequestRefusedError, match=r"logits processor TargetToken \(plugin 'TargetTokens'\) refused"):
        llm.generate([PROMPTS[0]], greedy(extra_args={"target_token": "five"}))
    assert isinstance(RequestRefusedError("x", plugin="p", hook="h"), ValueError)
    assert llm.generate([PROMPTS[0]], greedy(2))[0].token_ids


class CountsCalls(LogitsProcessor):
    calls = 0

    def __init__(self, config, device):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        CountsCalls.calls += 1
        return logits


def test_argmax_invariant_processors_are_skipped_when_every_request_is_greedy(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[AddsProcessors(CountsCalls)])
    CountsCalls.calls = 0
    llm.generate(PROMPTS, greedy(4))
    assert CountsCalls.calls == 0
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True))
    assert CountsCalls.calls == 4


class Explodes(TargetToken):
    """Fails in apply once a request asks for it, or in update_state as such a request joins."""

    def apply(self, logits):
        if any(t == -1 for t in self.targets.values()):
            raise RuntimeError("apply exploded")
        return super().apply(logits)

    def update_state(self, batch_update):
        for _, params, _, _ in batch_update.added if batch_update else ():
            how = (params.extra_args or {}).get("explode_on_join")
            if how == "refuse":  # what it can only judge with its state: a refusal of that request
                raise ValueError("this request asks for what the processor cannot do")
            if how:
                raise RuntimeError("update_state exploded")
        super().update_state(batch_update)

    @classmethod
    def validate_params(cls, params):
        pass


class ExplodingPlugin:
    @hookimpl
    def register_logits_processors(self, registry):
        registry.add(Explodes)


def test_a_processor_failing_in_apply_ends_that_steps_requests_naming_the_plugin_then_serves_others(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExplodingPlugin()])
    with pytest.raises(
        PluginHookError, match=r"logits processor Explodes \(plugin 'ExplodingPlugin'\) failed in apply"
    ):
        llm.generate([PROMPTS[0]], greedy(extra_args={"target_token": -1}))
    assert llm.generate([PROMPTS[1]], greedy(3, extra_args={"target_token": 9}))[0].token_ids == [9, 9, 9]
    assert llm.engine.scheduler.num_running == 0


def test_a_processor_failing_as_a_request_joins_ends_only_that_request(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExplodingPlugin()])

    async def scenario():
        decoding = asyncio.Event()

        async def long():
            outs = []
            async for out in engine.generate(PROMPTS[0], greedy(40, extra_args={"target_token": 8}), "long"):
                outs.append(out)
                if len(out.outputs[0].token_ids) >= 3:
                    decoding.set()
            return outs[-1]

        task = asyncio.ensure_future(long())
        await decoding.wait()
        with pytest.raises(PluginHookError, match="failed in update_state: RuntimeError: update_state exploded"):
            async for _ in engine.generate(PROMPTS[1], greedy(5, extra_args={"explode_on_join": True}), "bad"):
                pass
        return await task

    try:
        survivor = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    finally:
        engine.shutdown()
    assert survivor.outputs[0].token_ids == [8] * 40  # unaffected, and its target survived the rebuild


def test_of_requests_joining_in_one_step_a_processor_failing_on_one_ends_only_that_one(tiny_opt):
    """update_state takes a step's joiners together: its failure alone does not say whose it was."""
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExplodingPlugin()])
    asks = [
        greedy(3, extra_args={"target_token": 9}),
        greedy(3, extra_args={"explode_on_join": True}),
        greedy(3, extra_args={"target_token": 7}),
    ]
    requests = [llm.input_processor.make_request(f"r{i}", PROMPTS[i], p) for i, p in enumerate(asks)]
    llm.engine.submit(requests)  # together: they join in one step
    llm.engine.run_until(lambda: all(r.finished for r in requests))
    assert "update_state exploded" in str(requests[1].error)
    assert [r.error for r in (requests[0], requests[2])] == [None, None]
    assert [requests[i].output().outputs[0].token_ids for i in (0, 2)] == [[9, 9, 9], [7, 7, 7]]


def test_a_value_error_as_a_request_joins_refuses_that_request_alone_a_400_and_a_failure_stays_a_failure(tiny_opt):
    # It was the plugin's failure (a 500 server_error) for what is the request's fault: a word it cannot spell.
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExplodingPlugin()])
    refuse = greedy(3, extra_args={"explode_on_join": "refuse"})
    with pytest.raises(
        RequestRefusedError, match=r"^logits processor Explodes \(plugin 'ExplodingPlugin'\) refused the request: this"
    ) as info:
        llm.generate([PROMPTS[0]], refuse)
    assert (info.value.plugin, info.value.hook) == ("ExplodingPlugin", "register_logits_processors")
    asks = [
        greedy(3, extra_args={"target_token": 9}),
        refuse,
        greedy(3, extra_args={"explode_on_join": True}),
        greedy(3, extra_args={"target_token": 7}),
    ]
    requests = [llm.input_processor.make_request(f"r{i}", PROMPTS[i], p) for i, p in enumerate(asks)]
    llm.engine.submit(requests)  # together: they join in one step, and each is judged alone
    llm.engine.run_until(lambda: all(r.finished for r in requests))
    assert isinstance(requests[1].error, RequestRefusedError)
    assert isinstance(requests[2].error, PluginHookError) and not isinstance(requests[2].error, ValueError)
    assert "failed in update_state: RuntimeError: update_state exploded" in str(requests[2].error)  # its own
    assert [requests[i].output().outputs[0].token_ids for i in (0, 3)] == [[9, 9, 9], [7, 7, 7]]
    assert llm.engine.scheduler.num_running == 0

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExplodingPlugin()])
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base:
            body = {"model": "tiny", "prompt": [2, 5, 9], "max_tokens": 3, "extra_args": {"explode_on_join": "refuse"}}
            refused = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "(plugin 'ExplodingPlugin') refused the request: this request asks" in error["message"]
            streamed = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT)
            events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            assert events[-1]["error"]["type"] == "invalid_request_error", events
            failed = httpx.post(
                f"{base}/v1/completions", json={**body, "extra_args": {"explode_on_join": 1}}, timeout=TIMEOUT
            )
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
            del body["extra_args"]
            served = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


def test_a_processor_failing_as_the_batch_is_compacted_leaves_every_moved_row_its_own(tiny_opt):
    """The newcomer it fails on is ended; a row moved in the same update must still move in the cache."""
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[ExplodingPlugin()])
    alone = llm.generate([PROMPTS[3]], greedy(30))[0].token_ids
    short = [llm._inputs.make_request(f"short-{i}", PROMPTS[i], greedy(3)) for i in range(2)]
    third = llm._inputs.make_request("third", PROMPTS[2], greedy(30))
    fourth = llm._inputs.make_request("fourth", PROMPTS[3], greedy(30))
    llm.engine.submit([*short, third, fourth])  # rows 0-3
    while not all(r.finished for r in short):
        llm.engine.step()
    newcomer = llm._inputs.make_request("newcomer", PROMPTS[0], greedy(3, extra_args={"explode_on_join": True}))
    llm.engine.submit([newcomer])  # takes row 0; the fourth moves from row 3 to row 1: one update, which fails
    while not (fourth.finished and newcomer.finished):
        llm.engine.step()
    assert isinstance(newcomer.error, PluginHookError) and fourth.error is None
    assert fourth.output().token_ids == alone


class AllowsOnly(LogitsProcessor):
    """``extra_args={"allow": ids}``: only those tokens may follow (none, for an empty list); ``"nan"`` writes a NaN."""

    def __init__(self, config, device):
        self.rows = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.rows, batch_update, lambda params, _p, _o: (params.extra_args or {}).get("allow"))

    def apply(self, logits):
        for row, allow in self.rows.items():
            if allow == "nan":
                logits[row, 5] = float("nan")  # greedy argmax would pick it
                continue
            kept = logits[row, allow].clone()
            logits[row] = float("-inf")
            logits[row, allow] = kept
        return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    ("allow", "settings", "message"),
    [
        ([], {}, r"left this request no token to choose: every logit of its row was -inf or NaN"),
        ("nan", {}, r"left this request no token to choose: every logit of its row was -inf or NaN"),
        ([2], {"min_tokens": 3}, r"left this request only tokens that would end it, which min_tokens=3 forbids"),
    ],
    ids=["every token masked", "a NaN written", "only end-of-sequence left before min_tokens"],
)
def test_a_processor_leaving_a_request_no_token_ends_only_that_request_naming_the_plugin(
    tiny_opt, temperature, allow, settings, message
):
    # Greedy decoding took token 0 for ever; sampling raised a RuntimeError that ended every request of the step.
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[AddsProcessors(AllowsOnly)])

    def params(**extra_args):
        return SamplingParams(max_tokens=6, temperature=temperature, seed=3, **settings, extra_args=extra_args)

    alone = llm.generate([PROMPTS[1]], params())[0].token_ids
    bad = llm._inputs.make_request("bad", PROMPTS[0], params(allow=allow))
    good = llm._inputs.make_request("good", PROMPTS[1], params())
    llm.engine.submit([bad, good])
    llm.engine.run_until(lambda: bad.finished and good.finished)
    assert isinstance(bad.error, PluginHookError)
    assert (bad.error.plugin, bad.error.hook) == ("AddsProcessors", "register_logits_processors")
    assert re.search(r"^logits processor AllowsOnly \(plugin 'AddsProcessors'\) " + message, str(bad.error))
    assert good.error is None and good.output().token_ids == alone  # its batch-mate goes on, as if alone
    with pytest.raises(PluginHookError, match="AllowsOnly"):
        llm.generate([PROMPTS[2]], params(allow=allow))
    assert llm.generate([PROMPTS[1]], params())[0].token_ids == alone and llm.engine.scheduler.num_running == 0


# -- on_request, on_output, record_stats ----------------------------------------------------------------


class Guard:
    @hookimpl
    def on_request(self, request):
        if "refuse" in (request.params.extra_args or {}):
            raise ValueError("this site refuses such requests")
        request.params.max_tokens = min(request.params.max_tokens or 3, 3)  # a site limit, applied in place


def test_on_request_changes_a_request_or_refuses_it_naming_the_plugin(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Guard()])
    shared = greedy(10)
    assert [len(o.token_ids) for o in llm.generate(PROMPTS[:2], shared)] == [3, 3]
    assert shared.max_tokens == 10  # each request has its own parameters: the caller's are untouched
    with pytest.raises(ValueError, match=r"plugin 'Guard' refused the request: this site refuses such requests"):
        llm.generate([PROMPTS[0]], greedy(extra_args={"refuse": True}))
    assert len(llm.generate([PROMPTS[0]], greedy(10))[0].token_ids) == 3


class EmptiesPrompts:
    @hookimpl
    def on_request(self, request):
        if (request.params.extra_args or {}).get("empty"):
            request.prompt_token_ids = []


def test_a_request_an_on_request_hook_made_invalid_is_the_plugins_error_not_the_callers(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[EmptiesPrompts(), Guard()])
    with pytest.raises(PluginHookError, match=r"prompt 0 became invalid in the on_request hook of plugin '"):
        llm.generate([PROMPTS[0]], greedy(3, extra_args={"empty": 1}))  # it said "prompt 0 is an empty list"
    with pytest.raises(ValueError, match=r"^logprobs=100 is more than this engine allows") as caught:
        llm.generate([PROMPTS[0]], greedy(10, logprobs=100))  # Guard lowered max_tokens; the logprobs are the caller's
    assert not isinstance(caught.value, PluginHookError)
    with pytest.raises(ValueError, match=r"^logprobs=100 is more than") as caught:  # extra_args that == cannot compare
        llm.generate([PROMPTS[0]], greedy(10, logprobs=100, extra_args={"bias": torch.zeros(3)}))
    assert not isinstance(caught.value, PluginHookError)


class SetsATarget:
    @hookimpl
    def on_request(self, request):
        if (request.params.extra_args or {}).get("site_target"):
            request.params.extra_args = {"target_token": "five"}  # a value TargetToken refuses


def test_a_processor_refusing_what_an_on_request_hook_set_is_the_hooks_error_not_the_callers(tiny_opt):
    # It was a RequestRefusedError (a server's 400) about an option the caller never sent.
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[TargetTokens(), SetsATarget(), Guard()])
    with pytest.raises(PluginHookError, match=r"became invalid in the on_request hook of plugin 'SetsATarget'") as hook:
        llm.generate([PROMPTS[0]], greedy(3, extra_args={"site_target": True}))
    assert not isinstance(hook.value, RequestRefusedError) and "refused the request: target_token" in str(hook.value)
    with pytest.raises(RequestRefusedError, match=r"TargetToken \(plugin 'TargetTokens'\) refused"):
        llm.generate([PROMPTS[0]], greedy(10, extra_args={"target_token": "six"}))  # the caller's own: Guard changed


class PrependsASystemPrompt:
    @hookimpl
    def on_request(self, request):
        request.prompt_token_ids = [2] + [7] * 20 + request.prompt_token_ids[1:]


def test_a_prompt_a_plugin_lengthens_is_cut_to_fit_even_where_the_callers_own_max_tokens_must_fit(tiny_opt):
    # The server holds a client to max_tokens + prompt <= max_model_len; 20 tokens a plugin added made a request
    # that fitted a 500 (the plugin's error), where the engine cuts generation at max_model_len.
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[PrependsASystemPrompt()])
    try:

        async def scenario():
            fits = await engine.submit([2, 5, 9], greedy(120), exact_max_tokens=True)  # 3 + 120 <= 128
            final = [out async for out in fits][-1]
            with pytest.raises(ValueError, match="with max_tokens=126 that is 129") as caught:  # the caller's own
                await engine.submit([2, 5, 9], greedy(126), exact_max_tokens=True)
            return final, caught.value

        final, error = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    finally:
        engine.shutdown()
    assert (len(final.outputs[0].token_ids), final.outputs[0].finish_reason) == (128 - 23, "length")  # 23 prompt tokens
    assert not isinstance(error, PluginHookError)


def test_a_refusal_is_a_400_and_the_server_keeps_serving(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Guard()])
    try:
        with running_server(build_app(engine, served_model_name="guarded")) as base:
            body = {"model": "guarded", "prompt": [2, 5, 9], "max_tokens": 8}
            refused = httpx.post(f"{base}/v1/completions", json={**body, "extra_args": {"refuse": 1}}, timeout=TIMEOUT)
            assert refused.status_code == 400
            assert "plugin 'Guard' refused the request" in refused.json()["error"]["message"]
            served = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


class Policy:
    @hookimpl
    def on_request(self, request):
        if (request.params.extra_args or {}).get("forbidden"):
            raise PermissionError("this site does not answer that")

    @hookimpl
    def on_output(self, request, output):
        if (request.params.extra_args or {}).get("withhold"):
            raise PermissionError("this answer is withheld")


def test_a_permission_error_in_on_request_refuses_the_request_by_policy_a_400_and_the_server_keeps_serving(tiny_opt):
    # It said "refused, in its on_request hook" but was the plugin's failure: a 500 server_error for the client.
    forbidden = greedy(3, extra_args={"forbidden": True})
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Policy()])
    with pytest.raises(
        RequestRefusedError, match=r"^plugin 'Policy' refused the request: this site does not answer"
    ) as info:
        llm.generate([PROMPTS[0]], forbidden)
    assert (info.value.plugin, info.value.hook) == ("Policy", "on_request")
    assert isinstance(info.value.__cause__, PermissionError)
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Policy()])
    try:
        with running_server(build_app(engine, served_model_name="policy")) as base:
            body = {"model": "policy", "prompt": [2, 5, 9], "max_tokens": 3}
            refused = httpx.post(
                f"{base}/v1/completions", json={**body, "extra_args": {"forbidden": 1}}, timeout=TIMEOUT
            )
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == "plugin 'Policy' refused the request: this site does not answer that"
            served = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


def test_a_permission_error_in_on_output_withholds_the_output_as_a_refusal_a_400_and_the_server_keeps_serving(
    tiny_opt,
):
    # It said "refused, in its on_output hook" and was a 500 server_error, as if the plugin were broken.
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Policy()])
    with pytest.raises(
        RequestRefusedError, match=r"^plugin 'Policy' refused the request's output: this answer is withheld$"
    ) as info:
        llm.generate([PROMPTS[0]], greedy(3, extra_args={"withhold": True}))
    assert (info.value.plugin, info.value.hook) == ("Policy", "on_output")
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Policy()])
    try:
        with running_server(build_app(engine, served_model_name="policy")) as base:
            body = {"model": "policy", "prompt": [2, 5, 9], "max_tokens": 3}
            withheld = {**body, "extra_args": {"withhold": 1}}
            refused = httpx.post(f"{base}/v1/completions", json=withheld, timeout=TIMEOUT)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == "plugin 'Policy' refused the request's output: this answer is withheld"
            streamed = httpx.post(f"{base}/v1/completions", json={**withheld, "stream": True}, timeout=TIMEOUT)
            events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            assert events[-1]["error"]["type"] == "invalid_request_error", events
            # A refusal by policy, not a failure: an error-rate alert on finish_reason="error" does not fire for it.
            success = 'pluginhost_request_success_total{finish_reason="%s",model_name="policy"}'
            assert (metric(base, success % "refused"), metric(base, success % "error")) == (2, 0)
            served = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


class Redacts:
    @hookimpl
    def on_output(self, request, output):
        if (request.params.extra_args or {}).get("fail"):
            raise KeyError("no such redaction")
        for sample in output.outputs:
            sample.text = "[redacted]"


def test_on_output_changes_the_final_output_and_a_failure_ends_only_that_request(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Redacts()])
    out = llm.generate(["Hello world"], greedy(4))[0]
    assert out.text == "[redacted]" and len(out.token_ids) == 4
    with pytest.raises(PluginHookError, match=r"plugin 'Redacts' failed in its on_output hook: KeyError"):
        llm.generate(["Hello", "world"], [greedy(4, extra_args={"fail": True}), greedy(4)])
    assert llm.generate(["world"], greedy(2))[0].text == "[redacted]"


class DoublesAndMarks:
    @hookimpl
    def on_request(self, request):
        if (request.params.extra_args or {}).get("double"):
            request.params.n = 2

    @hookimpl
    def on_output(self, request, output):
        for sample in output.outputs:  # the start of the text: a stream has sent it already
            sample.text = "X" + (sample.text or "")[1:]


def test_the_server_numbers_choices_and_streams_text_as_the_hooks_left_them(tiny_opt):
    """n changed by on_request: every choice its own index; text changed by on_output: a stream is not garbled."""
    generated = LLM(str(tiny_opt), load_installed_plugins=False).generate(["Hello world"], greedy(12))[0].text
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[DoublesAndMarks()])
    try:
        with running_server(build_app(engine, served_model_name="m")) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
            asked = {"model": "m", "max_tokens": 4, "temperature": 0, "extra_body": {"extra_args": {"double": 1}}}
            whole = client.completions.create(prompt=["Hello", "world"], **asked)
            assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]  # two prompts x the n the plugin set
            finished = {}
            for chunk in client.completions.create(prompt=["Hello", "world"], stream=True, **asked):
                for c in chunk.choices:
                    finished[c.index] = finished.get(c.index) or c.finish_reason
            assert finished == dict.fromkeys(range(4), "length")
            plain = {"model": "m", "prompt": "Hello world", "max_tokens": 12, "temperature": 0}
            assert client.completions.create(**plain).choices[0].text == "X" + generated[1:]
            streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **plain) if c.choices)
            assert streamed == generated  # what was sent stays; the rest follows it, not cut at a length
    finally:
        engine.shutdown()


class Footer:
    @hookimpl
    def on_output(self, request, output):
        for sample in output.outputs:
            sample.text = (sample.text or "") + " [FOOTER]"


def test_a_sample_finishing_before_the_others_streams_what_the_hooks_made_of_it(tiny_opt):
    """n=2, the samples ending at different steps: the first one's stream ended before on_output ran (no footer)."""
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Footer()])
    body = {"model": "m", "prompt": "Hello world", "max_tokens": 12, "n": 2, "seed": 3, "temperature": 1.0}
    body["stop_token_ids"] = list(range(4, 150))  # most tokens end a sample: they end at different steps
    try:
        with running_server(build_app(engine, served_model_name="m")) as base:
            whole = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"]
            assert len({c["text"] for c in whole}) == 2 and all(c["text"].endswith(" [FOOTER]") for c in whole)
            texts: dict[int, str] = {}
            ends: dict[int, str] = {}
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
                for line in r.iter_lines():
                    for c in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                        ends[c["index"]] = ends.get(c["index"]) or c["finish_reason"]
            assert texts == {c["index"]: c["text"] for c in whole}
            assert ends == {c["index"]: c["finish_reason"] for c in whole}
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("sent", "changed", "rest"),
    [
        ("A plugin is a modu", "A [REDACTED] is a module", "le"),  # a change in what was sent
        (" the cat the cat", "the cat the cat the cat", " the cat"),  # repeated text: the nearest place, not the last
        ("abc", "xyz", ""),  # nothing of it left: no more
    ],
)
def test_a_stream_goes_on_after_the_text_it_sent(sent, changed, rest):
    from pluginhost.outputs import text_after

    assert text_after(sent, changed, "cmpl-1") == rest
    assert text_after(sent, sent + "more", "cmpl-1") == "more"  # the usual case: the text grew


class TrimsTokens:
    @hookimpl
    def on_output(self, request, output):
        for sample in output.outputs:
            sample.token_ids = sample.token_ids[:-1]


def test_token_ids_changed_without_their_logprobs_end_the_request_naming_the_plugin(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[TrimsTokens()])
    assert len(llm.generate([PROMPTS[0]], greedy(4))[0].token_ids) == 3  # no logprobs asked: nothing to pair
    with pytest.raises(PluginHookError, match=r"the on_output hook of plugin 'TrimsTokens' left sample\(s\) \[0\]"):
        llm.generate([PROMPTS[0]], greedy(4, logprobs=1))  # a server's answer failed on it: "internal error"


class LeavesAnIterator:
    @hookimpl
    def on_output(self, request, output):
        for sample in output.outputs:
            sample.logprobs = iter(sample.logprobs or [])


def test_logprobs_left_without_a_length_end_the_request_naming_the_plugin(tiny_opt):
    # The check itself raised TypeError after the request was forgotten: its stream never ended.
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[LeavesAnIterator()])
    with pytest.raises(PluginHookError, match=r"plugin 'LeavesAnIterator' left sample\(s\) \[0\] with logprobs that"):
        llm.generate([PROMPTS[0]], greedy(4, logprobs=1))


class EarlyOutput:  # wrappers returning before their yield: pluggy's error names no frame of the plugin's
    @hookimpl(wrapper=True)
    def on_output(self, request, output):
        if request is not None:
            return None
        yield


class EarlyRequest:
    @hookimpl(wrapper=True)
    def on_request(self, request):
        if request is not None:
            return None
        yield


class EarlyStats:
    @hookimpl(wrapper=True)
    def record_stats(self, stats):
        if stats is not None:
            return None
        yield


def test_a_hook_failing_with_no_frame_of_its_own_is_still_blamed_on_its_plugin(tiny_opt, caplog):
    """pluggy's "did not yield" escaped the step: a stream never ended, record_stats failed every request."""

    async def main(plugin: object) -> tuple[object, object]:
        engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin])
        try:
            outcomes = []
            for request_id, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):  # the second: it serves on
                try:
                    async with asyncio.timeout(30):
                        outcomes.append([out async for out in engine.generate(prompt, greedy(3), request_id)][-1])
                except PluginHookError as exc:
                    outcomes.append(exc)
            return outcomes[0], outcomes[1]
        finally:
            engine.shutdown()

    failed, after = asyncio.run(main(EarlyOutput()))
    assert "plugin 'EarlyOutput' failed in its on_output hook: RuntimeError: wrap_controller" in str(failed)
    assert isinstance(after, PluginHookError)  # every request's output goes through the same hook
    refused, _ = asyncio.run(main(EarlyRequest()))
    assert "plugin 'EarlyRequest' failed in its on_request hook" in str(refused)
    with caplog.at_level(logging.ERROR, logger="pluginhost"):
        llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[EarlyStats()])
        assert len(llm.generate([PROMPTS[0]], greedy(3))[0].token_ids) == 3
        assert len(llm.generate([PROMPTS[1]], greedy(3))[0].token_ids) == 3
    assert caplog.text.count("plugin 'EarlyStats' failed in its record_stats hook") == 1


def test_record_stats_sees_every_step_and_a_failing_one_is_logged_once_and_dropped(tiny_opt, caplog):
    seen = []

    class Records:
        @hookimpl
        def record_stats(self, stats):
            seen.append(stats)

    class Breaks:
        calls = 0

        @hookimpl(tryfirst=True)
        def record_stats(self, stats):
            Breaks.calls += 1
            raise ZeroDivisionError("oops")

    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Records(), Breaks()])
    steps = []
    llm.engine.stats_listeners.append(steps.append)
    with caplog.at_level(logging.ERROR, logger="pluginhost"):
        outs = llm.generate(PROMPTS, greedy(5))
        llm.generate(PROMPTS[:1], greedy(5))
    assert [len(o.token_ids) for o in outs] == [5, 5, 5, 5]  # the engine went on
    failures = [r for r in caplog.records if "record_stats" in r.getMessage()]
    assert len(failures) == 1 and "plugin 'Breaks'" in failures[0].getMessage() and Breaks.calls == 1
    assert seen == steps  # the other implementation saw every step, the one its neighbour failed in too
    assert seen[-1].num_running >= 1 and seen[-1].step_time_s > 0


# -- register_routes ------------------------------------------------------------------------------------------


class Hello:
    @hookimpl
    def register_routes(self, app, engine):
        @app.get("/v1/hello")
        async def hello():
            return {"model": engine.config.model, "vocab": engine.vocab_size}


class ModelInfo:
    @hookimpl
    def register_routes(self, app):
        @app.get("/v1/models/{name}/info")
        async def info(name: str):
            return {"info": name}


class TakesHealth:
    @hookimpl
    def register_routes(self, app):
        @app.get("/health")
        async def mine():
            return {"mine": True}


def test_register_routes_adds_routes_behind_the_api_key(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Hello()])
    try:
        with running_server(build_app(engine, served_model_name="tiny", api_key="k")) as base:
            assert httpx.get(f"{base}/v1/hello", timeout=TIMEOUT).status_code == 401
            answer = httpx.get(f"{base}/v1/hello", headers={"Authorization": "Bearer k"}, timeout=TIMEOUT).json()
            assert answer == {"model": str(tiny_opt), "vocab": 384}
    finally:
        engine.shutdown()


class BrokenRoute:
    @hookimpl
    def register_routes(self, app):
        @app.get("/v1/broken")
        async def broken():
            raise RuntimeError("route handler broke")


def test_a_plugin_route_that_raises_is_a_500_naming_the_plugin_logged_once(tiny_opt, caplog):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[BrokenRoute()])
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base, caplog.at_level("ERROR"):
            answer = httpx.get(f"{base}/v1/broken", timeout=TIMEOUT)
            assert answer.status_code == 500 and answer.json()["error"]["code"] == "plugin_error"
            assert "internal error in a route of plugin 'BrokenRoute': RuntimeError: route handler broke" in answer.text
            assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200  # and it serves on
        assert len([r for r in caplog.records if "route handler broke" in str(r.exc_info)]) == 1
    finally:
        engine.shutdown()


def test_a_plugin_route_under_v1_models_is_reached_before_the_models_route(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[ModelInfo()])
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base:
            assert httpx.get(f"{base}/v1/models/tiny/info", timeout=TIMEOUT).json() == {"info": "tiny"}
            assert httpx.get(f"{base}/v1/models/tiny", timeout=TIMEOUT).json()["id"] == "tiny"
            assert httpx.get(f"{base}/v1/models/other", timeout=TIMEOUT).status_code == 404
    finally:
        engine.shutdown()


class TakesModelCards:
    @hookimpl
    def register_routes(self, app):
        @app.get("/v1/models/{name}")  # another name for the builtin's parameter: the same URLs
        async def card(name: str):
            return {"mine": name}


class MountsV1:
    @hookimpl
    def register_routes(self, app):
        from fastapi import FastAPI

        app.mount("/v1", FastAPI())  # would answer /v1/models/NAME, registered after it


@pytest.mark.parametrize(
    ("plugin", "taken"),
    [
        (TakesHealth, r"route /health is already taken by the server itself\."),
        (TakesModelCards, r"route /v1/models/\{name\} is already taken by the server itself \(/v1/models/"),
        (MountsV1, r"route /v1 is already taken by the server itself \(/v1/models/\{model:path\}\)"),
    ],
)
def test_a_route_taking_a_builtin_path_stops_the_server_naming_the_plugin(tiny_opt, plugin, taken):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin()])
    try:
        with pytest.raises(PluginHookError, match=rf"plugin '{plugin.__name__}' failed in its register_routes hook: "):
            build_app(engine, served_model_name="tiny")
        with pytest.raises(PluginHookError, match=taken):
            build_app(engine, served_model_name="tiny")
    finally:
        engine.shutdown()


class DeletesModels:
    @hookimpl
    def register_routes(self, app):
        @app.delete("/v1/models/{name}")  # another method: GET /v1/models/NAME is still the server's
        async def unload(name: str):
            return {"unloaded": name}

        @app.post("/{rest:path}")  # a POST catch-all: every builtin came first
        async def anything(rest: str):
            return {"rest": rest}


def test_routes_that_take_no_builtin_url_are_added(tiny_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[DeletesModels()])
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base:
            assert httpx.delete(f"{base}/v1/models/tiny", timeout=TIMEOUT).json() == {"unloaded": "tiny"}
            assert httpx.get(f"{base}/v1/models/tiny", timeout=TIMEOUT).json()["id"] == "tiny"
            body = {"model": "tiny", "prompt": [2, 5], "max_tokens": 2}
            completion = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
            assert completion["object"] == "text_completion"
            assert httpx.post(f"{base}/v1/other", timeout=TIMEOUT).json() == {"rest": "v1/other"}
    finally:
        engine.shutdown()


def test_a_route_collision_through_the_cli_exits_2(install_plugin, tiny_opt):
    import subprocess
    import sys

    site = install_plugin(
        "grabs_metrics",
        "from pluginhost import hookimpl\n@hookimpl\ndef register_routes(app):\n    app.get('/metrics')(lambda: {})\n",
        dist="grabs-dist",
    )
    result = subprocess.run(
        [sys.executable, "-m", "pluginhost", "serve", "--model", str(tiny_opt), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={"PYTHONPATH": f"{site}:{':'.join(sys.path)}", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stderr
    assert "plugin 'grabs_metrics' (distribution grabs-dist 1.0) failed in its register_routes hook" in result.stderr
    assert "route /metrics is already taken by the server itself" in result.stderr and "Traceback" not in result.stderr


def test_runtime_hooks_are_listed_by_pluginhost_plugins(install_plugin, capsys):
    from pluginhost.cli import main

    install_plugin(
        "everything",
        "from pluginhost import hookimpl\n"
        "@hookimpl\ndef on_request(request): pass\n"
        "@hookimpl\ndef on_output(request, output): pass\n"
        "@hookimpl\ndef record_stats(stats): pass\n"
        "@hookimpl\ndef register_routes(app, engine): pass\n"
        "@hookimpl\ndef register_logits_processors(registry): pass\n",
    )
    assert main(["plugins", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "everything")
    assert row["hooks"] == sorted(
        ["on_request", "on_output", "record_stats", "register_routes", "register_logits_processors"]
    )


class CreatedOnce(TargetToken):
    """Fails in apply, and cannot be created a second time: the engine's rebuild fails too."""

    made = 0

    def __init__(self, vllm_config, device, is_pin_memory=False):
        CreatedOnce.made += 1
        if CreatedOnce.made > 1:
            raise RuntimeError("resource already taken")
        super().__init__(vllm_config, device, is_pin_memory)

    def apply(self, logits):
        raise RuntimeError("apply broke")


def test_a_processor_that_cannot_be_created_again_is_named_at_every_step_it_fails(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[AddsProcessors(CreatedOnce)])
    with pytest.raises(PluginHookError, match=r"CreatedOnce .* failed in apply: RuntimeError: apply broke"):
        llm.generate([PROMPTS[0]], greedy(3))
    with pytest.raises(PluginHookError, match=r"CreatedOnce .* could not be created again .* resource already taken"):
        llm.generate([PROMPTS[0]], greedy(3))  # a bare RuntimeError escaped the engine step, naming no plugin
