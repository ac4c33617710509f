"""Property tests: validation of SamplingParams and EngineConfig, and the allow/deny lists."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pluginhost import EngineConfig
from pluginhost.config import describe_validation_error
from pluginhost.sampling import SamplingParams
from pluginhost.selection import PluginSelection, normalize_name, parse_name_list

settings.register_profile("pluginhost", max_examples=150, deadline=None)
settings.load_profile("pluginhost")

finite = st.floats(allow_nan=False, allow_infinity=False)

# -- SamplingParams -------------------------------------------------------------------

valid_sampling = st.fixed_dictionaries(
    {
        "n": st.integers(1, 64),
        "max_tokens": st.integers(1, 10_000),
        "min_tokens": st.integers(0, 1),
        "temperature": st.floats(0, 100),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(0, 100_000),
        "min_p": st.floats(0, 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 1e6, exclude_min=True),
        "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
        "logprobs": st.none() | st.integers(0, 100),
        "stop": st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 2**31), min_size=1, max_size=5),
        "ignore_eos": st.booleans(),
        "extra_args": st.none() | st.dictionaries(st.text(max_size=5), st.integers()),
    }
)


@given(valid_sampling)
def test_valid_sampling_params_are_kept_as_given(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value
    assert params.greedy == (kwargs["temperature"] < 1e-5)
    assert SamplingParams(stop="end").stop == ["end"]  # one string is a list of one, as in vLLM


invalid_field = st.one_of(
    st.tuples(st.just("max_tokens"), st.integers(max_value=0) | st.just(True) | finite),
    st.tuples(st.just("temperature"), st.floats(max_value=0, exclude_max=True) | st.just(math.nan) | st.just(math.inf)),
    st.tuples(st.just("top_p"), st.floats(max_value=0) | st.floats(min_value=1, exclude_min=True) | st.just(math.nan)),
    st.tuples(st.just("top_k"), st.integers(max_value=-2) | st.floats()),
    st.tuples(st.just("n"), st.integers(max_value=0) | finite),
    st.tuples(st.just("min_p"), st.floats(min_value=1, exclude_min=True) | st.floats(max_value=0, exclude_max=True)),
    st.tuples(st.just("presence_penalty"), st.floats(min_value=2, exclude_min=True) | st.just(math.nan)),
    st.tuples(st.just("frequency_penalty"), st.floats(max_value=-2, exclude_max=True) | st.just(math.inf)),
    st.tuples(st.just("repetition_penalty"), st.floats(max_value=0) | st.just(math.nan)),
    st.tuples(st.just("stop"), st.just("") | st.lists(st.integers(), min_size=1, max_size=2)),
    st.tuples(st.just("extra_args"), st.lists(st.integers(), max_size=2) | st.text(max_size=3)),
    st.tuples(st.just("logprobs"), st.integers(max_value=-2) | st.text(max_size=3)),
    st.tuples(st.just("seed"), finite | st.text(max_size=3)),
    st.tuples(st.just("stop_token_ids"), st.lists(st.integers(max_value=-1), min_size=1, max_size=3)),
)


@given(valid_sampling, invalid_field)
def test_any_invalid_sampling_field_raises_value_error_naming_it(kwargs, bad):
    field, value = bad
    with pytest.raises(ValueError, match=rf"SamplingParams: {field} must"):
        SamplingParams(**{**kwargs, field: value})


# -- EngineConfig ---------------------------------------------------------------------

devices = st.sampled_from(["auto", "cpu", "cuda"]) | st.integers(0, 64).map(lambda n: f"cuda:{n}")


@given(
    dtype=st.sampled_from(["auto", "float32", "float16", "bfloat16"]),
    device=devices,
    max_model_len=st.none() | st.integers(1, 1 << 20),
    seed=st.integers(-(2**31), 2**31),
)
def test_valid_engine_configs_are_accepted_and_marked_user(dtype, device, max_model_len, seed):
    config = EngineConfig(model="m", dtype=dtype, device=device, max_model_len=max_model_len, seed=seed)
    assert (config.dtype, config.device, config.max_model_len, config.seed) == (dtype, device, max_model_len, seed)
    assert all(config.provenance[f] == "user" for f in ("dtype", "device", "max_model_len", "seed"))
    assert config.provenance["hf_overrides"] == "default"


bad_values = st.one_of(
    st.tuples(
        st.just("dtype"), st.text(max_size=10).filter(lambda s: s not in {"auto", "float32", "float16", "bfloat16"})
    ),
    st.tuples(st.just("device"), st.text(max_size=10).filter(lambda s: not re.fullmatch(r"auto|cpu|cuda(:\d+)?", s))),
    st.tuples(st.just("max_model_len"), st.integers(max_value=0)),
    st.tuples(st.just("max_num_seqs"), st.integers(max_value=0)),
    st.tuples(st.just("model"), st.text(alphabet=" \t\n", max_size=4)),
)


@given(bad_values)
def test_invalid_engine_config_values_are_refused_and_leave_the_config_unchanged(bad):
    field, value = bad
    with pytest.raises(ValidationError) as info:
        EngineConfig(**{"model": "m", field: value})
    assert describe_validation_error(info.value).startswith(field)
    config = EngineConfig(model="m")
    before = config.model_dump()
    with pytest.raises(ValidationError):
        setattr(config, field, value)
    assert config.model_dump() == before
    assert config.provenance[field] == ("user" if field == "model" else "default")


@given(st.text(alphabet=st.characters(categories=["Ll", "Lu", "Nd"]), min_size=1, max_size=12))
def test_unknown_engine_config_fields_are_refused(name):
    if name in EngineConfig.model_fields:
        return
    with pytest.raises(ValidationError) as info:
        EngineConfig(**{"model": "m", name: 1})
    assert "unknown setting" in describe_validation_error(info.value)


# -- allow and deny lists -------------------------------------------------------------

names = st.from_regex(r"[A-Za-z][A-Za-z0-9]{0,5}([-_.][A-Za-z0-9]{1,5}){0,2}", fullmatch=True)
padding = st.text(alphabet=" \t", max_size=3)


@given(st.lists(st.tuples(padding, names, padding), max_size=6), st.integers(0, 2))
def test_name_lists_split_on_commas_and_strip_spaces(items, empties):
    text = ",".join(f"{a}{n}{b}" for a, n, b in items) + "," * empties
    assert parse_name_list(text) == tuple(n for _, n, _ in items)


def variant(name: str, data: st.DataObject) -> str:
    """The same name as a user might type it: other case, other separators."""
    swapped = "".join(data.draw(st.sampled_from("-_.")) if c in "-_." else c for c in name)
    return swapped.upper() if data.draw(st.booleans()) else swapped.lower()


@given(names, st.data())
def test_names_match_whatever_the_case_and_separators(name, data):
    assert normalize_name(variant(name, data)) == normalize_name(name)
    assert normalize_name(normalize_name(name)) == normalize_name(name)


@given(st.lists(names, min_size=1, max_size=5, unique_by=normalize_name), st.data())
def test_allow_list_admits_exactly_the_listed_plugins(installed, data):
    allowed = data.draw(st.lists(st.sampled_from(installed), unique=True))
    env = {"PLUGINHOST_PLUGINS": ",".join(variant(n, data) for n in allowed)}
    selection = PluginSelection.from_env(env)
    for name in installed:
        loads = selection.decide(name, f"dist-of-{name}") is None
        assert loads == (name in allowed)
    assert selection.unmatched_allowed([(n, None) for n in installed]) == []


@given(st.lists(names, min_size=1, max_size=5, unique_by=normalize_name), st.data())
def test_deny_list_wins_over_the_environment_allow_list(installed, data):
    denied = data.draw(st.lists(st.sampled_from(installed), unique=True))
    env = {
        "PLUGINHOST_PLUGINS": ",".join(installed),
        "PLUGINHOST_DISABLED_PLUGINS": ",".join(variant(n, data) for n in denied),
    }
    selection = PluginSelection.from_env(env)
    for name in installed:
        reason = selection.decide(name, None)
        assert (reason is None) == (name not in denied)
        if name in denied:
            assert reason == "disabled by PLUGINHOST_DISABLED_PLUGINS"


@given(st.lists(names, min_size=1, max_size=5, unique_by=normalize_name), st.data())
def test_cli_allow_list_replaces_the_environment_and_beats_its_denials(installed, data):
    env_allowed = data.draw(st.lists(st.sampled_from(installed), unique=True))
    cli_allowed = data.draw(st.lists(st.sampled_from(installed), min_size=1, unique=True))
    env = {"PLUGINHOST_PLUGINS": ",".join(env_allowed), "PLUGINHOST_DISABLED_PLUGINS": ",".join(installed)}
    selection = PluginSelection.from_env(env).with_cli(plugins=",".join(cli_allowed))
    for name in installed:
        assert (selection.decide(name, None) is None) == (name in cli_allowed)
    assert PluginSelection.from_env(env).with_cli(no_plugins=True).decide(installed[0], None) is not None


@given(st.lists(names, min_size=1, max_size=4, unique_by=normalize_name), names)
def test_allow_list_names_that_match_nothing_are_reported(installed, stranger):
    if normalize_name(stranger) in {normalize_name(n) for n in installed}:
        return
    selection = PluginSelection.from_env({"PLUGINHOST_PLUGINS": f"{installed[0]},{stranger}"})
    assert selection.unmatched_allowed([(n, None) for n in installed]) == [stranger]
