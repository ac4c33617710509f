"""The loading progress bar: shown on a terminal for large checkpoints, quiet otherwise or when asked."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import pluginhost.checkpoint as checkpoint
from pluginhost.checkpoint import find_checkpoint


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def read_all(model_dir, stream, monkeypatch) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    names = [name for name, _ in find_checkpoint(model_dir).tensors(dtype=torch.float32, device=torch.device("cpu"))]
    assert names
    return stream.getvalue()


@pytest.fixture
def everything_is_large(monkeypatch):
    monkeypatch.setattr(checkpoint, "_PROGRESS_MIN_BYTES", 0)


def test_progress_bar_on_a_terminal(tiny_opt, monkeypatch, everything_is_large):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert "loading weights" in read_all(tiny_opt, Terminal(), monkeypatch)


def test_no_progress_bar_when_not_a_terminal(tiny_opt, monkeypatch, everything_is_large):
    assert read_all(tiny_opt, io.StringIO(), monkeypatch) == ""


def test_no_progress_bar_when_asked(tiny_opt, monkeypatch, everything_is_large):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert read_all(tiny_opt, Terminal(), monkeypatch) == ""


def test_no_progress_bar_for_small_checkpoints(tiny_opt, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert read_all(tiny_opt, Terminal(), monkeypatch) == ""
