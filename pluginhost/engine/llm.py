"""``LLM``: offline generation, vLLM's way, on the engine loop.

>>> llm = LLM(model="path/to/opt", dtype="float32")          # doctest: +SKIP
>>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]
>>> out.outputs[0].text, out.token_ids, out.finish_reason     # doctest: +SKIP

``generate`` submits its prompts together and steps the engine loop in the
caller's thread until they are done; several threads may call it on one
``LLM`` at once, and their requests share the batch. Each gets exactly what it
would get alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pluginhost.engine.frontend import EngineFrontend, no_lora_or_priority
from pluginhost.engine.inputs import Prompt, as_prompt_list
from pluginhost.outputs import RequestOutput
from pluginhost.sampling import SamplingParams, kind_of

if TYPE_CHECKING:
    from pluginhost.engine.core import EngineCore
    from pluginhost.engine.request import EngineRequest

__all__ = ["LLM"]


class LLM(EngineFrontend):
    """An engine: one model, built once, generating for any number of requests.

    Takes every ``EngineConfig`` field as a keyword argument, plus ``plugins``
    (in-process plugin objects or ``register()`` functions, no packaging
    needed) and ``load_installed_plugins`` (``False`` skips entry points).
    vLLM's settings for its own machinery are taken at the values that ask for
    nothing else (``gpu_memory_utilization=0.9``, ``enforce_eager=True``...) and
    refused at others (``pluginhost.config.take_vllm_settings``).
    """

    # -- generating ----------------------------------------------------------------

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Generate the answer to a conversation (a list of messages), or to each of a list of them, as vLLM's.

        Messages are OpenAI's: ``{"role": "user", "content": "Hi"}``, content a string or text parts; the
        tokenizer's chat template (or ``chat_template``) renders them, as the server's ``/v1/chat/completions``
        does, so an answer is the same offline and served. ``chat_template_kwargs`` are the template's variables
        (Qwen3's ``{"enable_thinking": False}``), and override the arguments before them, as in vLLM;
        ``continue_final_message`` (with ``add_generation_prompt=False``) goes on with the last message instead of
        starting the assistant's. A message the API does not allow (checked as the server checks it: an unknown
        key too), or a template that cannot render them, raises ``ValueError`` before anything runs.
        """
        from pluginhost.chat import chat_prompts

        prompts = chat_prompts(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; one ``RequestOutput`` per prompt, in prompt order.

        A prompt is text, a list of token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. A bad prompt or parameter raises
        ``ValueError`` before anything runs, and the engine stays usable. A
        model failure raises ``ModelRunError`` naming the model.

        ``use_tqdm``, as in vLLM: a progress bar of the prompts done, on stderr
        when it is a terminal (``False``: none; a callable: it makes the bar,
        called like ``tqdm.tqdm``). vLLM's ``lora_request`` and ``priority`` are
        taken as a port passes them when it asks for neither (``None``; every
        priority 0), and refused otherwise.
        """
        self._check_generates()
        prompt_list = as_prompt_list(prompts)
        no_lora_or_priority(lora_request, priority, len(prompt_list))
        params_list = _params_for(prompt_list, sampling_params, self.get_default_sampling_params)
        if not prompt_list:
            return []
        requests = [
            self._inputs.make_request(self._new_request_id(), prompt, params, index=i)
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True))
        ]
        bar = _progress_bar(use_tqdm, len(requests))  # before anything is submitted: it may fail
        ended = _Ended(requests, self.engine, bar)
        for request in requests:
            request.on_end = ended.count
        self.engine.submit(requests, bounded=False)
        try:
            self.engine.run_until(ended.all)
        except BaseException:
            for request in requests:  # Ctrl-C or an engine bug: end ours, keep the rest
                self.engine.abort_request(request)
            raise
        finally:
            if bar is not None:
                bar.close()
        for request in requests:
            if request.error is not None:
                raise request.error
        return [r.output() for r in requests]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:  # noqa: ANN401 - a tqdm bar
    if not use_tqdm:
        return None
    if callable(use_tqdm):  # the caller's bar, with the caller's settings (vLLM passes total and desc)
        return use_tqdm(total=total, desc="Processed prompts")
    from tqdm.auto import tqdm

    # disable=None: tqdm shows the bar only when stderr is a terminal (logs and pipes stay clean).
    return tqdm(total=total, desc="Processed prompts", unit="prompt", disable=None, leave=False)


class _Ended:
    """Whether a call's requests have all ended, counted as each ends (looking at every request after every step
    cost a call of 20,000 prompts a quarter of its time); the progress bar follows the count.

    The requests themselves are looked at only once the count says all have ended, or the engine has nothing
    left to do: the count is a hint, never the answer.
    """

    def __init__(self, requests: list[EngineRequest], engine: EngineCore, bar: Any) -> None:  # noqa: ANN401 - tqdm
        self.requests, self.engine, self.bar, self.n = requests, engine, bar, 0

    def count(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)

    def all(self) -> bool:
        if self.n < len(self.requests) and self.engine.has_work():
            return False
        return all(r.finished for r in self.requests)


def _params_for(
    prompts: list[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in prompts]
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if isinstance(params, str | bytes) or not isinstance(params, Sequence):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {kind_of(params)}")
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(
            f"sampling_params must be one SamplingParams or one per prompt ({len(prompts)}), got {len(params)} items"
        )
    bad = [i for i, p in enumerate(params) if not isinstance(p, SamplingParams)]
    if bad:
        raise ValueError(
            f"sampling_params[{bad[0]}] is {kind_of(params[bad[0]])}, not SamplingParams: give one per prompt"
        )
    return params
