"""The stats logger, tested with pluginhost's pytest fixtures."""

import json
import logging

import pluginhost_stats_logger
import pytest

from pluginhost import SamplingParams

FIELDS = {
    "time",
    "num_running",
    "num_waiting",
    "num_generated_tokens",
    "num_prompt_tokens",
    "num_finished",
    "step_time_s",
    "cache_shape",
    "num_preempted",
}


@pytest.fixture(autouse=True)
def closed_after(monkeypatch):
    monkeypatch.delenv(pluginhost_stats_logger.VARIABLE, raising=False)
    yield
    pluginhost_stats_logger._writer.close()


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_json_line_per_step_with_the_right_token_counts(make_engine, hook_recorder, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(pluginhost_stats_logger.VARIABLE, str(path))
    llm = make_engine(pluginhost_stats_logger, max_num_seqs=2)  # three sequences: one waits for a row
    prompts = [[2, 5, 6], [2, 7], [2, 8, 9, 10]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 6, 4)]
    outs = llm.generate(prompts, params)

    steps = lines(path)
    assert len(steps) == hook_recorder.names().count("record_stats") > 0
    assert all(set(step) == FIELDS for step in steps)
    assert sum(s["num_generated_tokens"] for s in steps) == sum(len(o.outputs[0].token_ids) for o in outs) == 13
    assert sum(s["num_prompt_tokens"] for s in steps) == sum(map(len, prompts))
    assert sum(s["num_finished"] for s in steps) == 3
    assert max(s["num_running"] for s in steps) == 2 and steps[0]["num_waiting"] == 1
    assert all(s["step_time_s"] > 0 and len(s["cache_shape"]) == 2 for s in steps)
    assert [s["time"] for s in steps] == sorted(s["time"] for s in steps)


def test_the_file_stays_open_and_is_appended_to(make_engine, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(pluginhost_stats_logger.VARIABLE, str(path))
    llm = make_engine(pluginhost_stats_logger)
    llm.generate([[2, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
    opened = pluginhost_stats_logger._writer.file
    assert len(lines(path)) == 2  # flushed at once: readable while the file is still open
    llm.generate([[2, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert pluginhost_stats_logger._writer.file is opened and not opened.closed
    assert [s["num_generated_tokens"] for s in lines(path)] == [1] * 5

    other = tmp_path / "other.jsonl"  # a new name is taken at the next step
    monkeypatch.setenv(pluginhost_stats_logger.VARIABLE, str(other))
    llm.generate([[2, 5]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert opened.closed and len(lines(other)) == 1 and len(lines(path)) == 5


def test_nothing_is_written_when_the_variable_is_unset(make_engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_engine(pluginhost_stats_logger).generate([[2, 5]], SamplingParams(max_tokens=3))
    assert list(tmp_path.iterdir()) == [] and pluginhost_stats_logger._writer.file is None


def test_a_file_that_cannot_be_opened_is_logged_once_and_generation_goes_on(make_engine, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(pluginhost_stats_logger.VARIABLE, str(tmp_path / "missing-dir" / "steps.jsonl"))
    llm = make_engine(pluginhost_stats_logger)
    with caplog.at_level(logging.ERROR):
        out = llm.generate([[2, 5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "plugin 'pluginhost_stats_logger' failed in its record_stats hook: FileNotFoundError" in errors[0]
