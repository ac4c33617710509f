"""The shipped demo model: intact, checked on use, and writing words from the docs it was trained on."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pluginhost import LLM, SamplingParams
from pluginhost.demo import MANIFEST_NAME, demo_model_path, ensure_demo_model, verify_demo_model
from pluginhost.errors import ConfigError

DEMO = demo_model_path()
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py"
CORPUS = (DEMO / "corpus.txt").read_text(encoding="utf-8")
#: Prompts taken from the corpus; the model should carry on in the docs' words.
PROMPTS = ["A plugin is", "The builtin architectures", "Every hook", "Loading a checkpoint"]


def words(text: str) -> list[str]:
    """Whitespace-separated words, lower-cased, without surrounding punctuation or Markdown marks."""
    stripped = (w.strip(".,;:!?()[]{}\"'`*_<>|-").lower() for w in text.split())
    return [w for w in stripped if w]


CORPUS_WORDS = set(words(CORPUS))


def corpus_word_share(text: str) -> float:
    found = words(text)
    return sum(w in CORPUS_WORDS for w in found) / max(len(found), 1)


def longest_corpus_run(text: str) -> int:
    """The most consecutive words of ``text`` that appear together, in order, in the corpus."""
    found, corpus = words(text), " ".join(words(CORPUS))
    best = 0
    for start in range(len(found)):
        for end in range(start + best + 1, len(found) + 1):
            if f" {' '.join(found[start:end])} " not in f" {corpus} ":
                break
            best = end - start
    return best


# -- the files ----------------------------------------------------------------------------


def test_the_shipped_files_match_the_manifest():
    listed = {line.split("  ", 1)[1] for line in (DEMO / MANIFEST_NAME).read_text(encoding="utf-8").splitlines()}
    assert listed == {p.name for p in DEMO.iterdir() if p.is_file()} - {MANIFEST_NAME}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "corpus.txt"} <= listed
    verify_demo_model(DEMO)
    assert ensure_demo_model() == DEMO


def test_the_weights_are_small_float16_and_the_head_is_tied():
    from safetensors import safe_open

    config = json.loads((DEMO / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["OPTForCausalLM"] and config["dtype"] == "float16"
    assert (DEMO / "model.safetensors").stat().st_size < 5_000_000
    with safe_open(DEMO / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {str(f.get_slice(name).get_dtype()) for name in names} == {"F16"}
    assert "lm_head.weight" not in names and "model.decoder.embed_tokens.weight" in names


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DEMO, tmp_path / "demo"))


def test_a_copy_verifies(demo_copy):
    verify_demo_model(demo_copy)


def test_a_flipped_byte_is_a_clear_error(demo_copy):
    weights = demo_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as caught:
        verify_demo_model(demo_copy)
    message = str(caught.value)
    assert message.startswith("The installed demo model is corrupt: model.safetensors has SHA-256 ")
    assert str(demo_copy) in message and "Reinstall pluginhost" in message


@pytest.mark.parametrize(
    ("damage", "detail"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json cannot be read"),
        (lambda d: (d / MANIFEST_NAME).unlink(), f"its manifest {MANIFEST_NAME} cannot be read"),
        (lambda d: (d / MANIFEST_NAME).write_text("not a manifest\n"), f"line 1 of {MANIFEST_NAME}"),
        (lambda d: (d / MANIFEST_NAME).write_text(""), f"{MANIFEST_NAME} lists no files"),
    ],
    ids=["missing-file", "missing-manifest", "malformed-manifest", "empty-manifest"],
)
def test_other_damage_is_a_clear_error(demo_copy, damage, detail):
    damage(demo_copy)
    with pytest.raises(ConfigError, match=f"^The installed demo model is corrupt: {re.escape(detail)}"):
        verify_demo_model(demo_copy)


# -- what it writes -------------------------------------------------------------------------


def test_greedy_text_is_made_of_the_docs_words(demo_llm):
    outs = demo_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(words(out.text)) >= 8, (prompt, out.text)
        # A random model's words are mostly glued-together word pieces; this one recites the docs.
        assert corpus_word_share(out.text) >= 0.8, (prompt, out.text)
        assert longest_corpus_run(out.text) >= 5, (prompt, out.text)


def test_a_random_model_with_the_same_tokenizer_fails_that_check(tmp_path):
    """The check above means something: untrained weights of the same shape do not pass it."""
    import torch
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp_path / name)
    generator = torch.Generator().manual_seed(0)
    random = {  # initialised as transformers initialises an OPT
        name: torch.ones_like(t)
        if "layer_norm.weight" in name
        else torch.zeros_like(t)
        if name.endswith("bias")
        else (0.02 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in load_file(DEMO / "model.safetensors").items()
    }
    save_file(random, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path), load_installed_plugins=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert not any(corpus_word_share(o.text) >= 0.8 and longest_corpus_run(o.text) >= 5 for o in outs)


def test_the_engine_and_transformers_agree_on_greedy_tokens(demo_llm):
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    prompt_ids = demo_llm.tokenizer(PROMPTS[0])["input_ids"]
    ours = demo_llm.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor([prompt_ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=1
        )
    assert ours.token_ids == theirs[0, len(prompt_ids) :].tolist()


# -- chat -------------------------------------------------------------------------------------


def test_the_chat_template_renders(demo_llm):
    tokenizer = demo_llm.tokenizer
    question = [{"role": "user", "content": "What is a plugin?"}]
    assert tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False) == (
        "</s>### User:\nWhat is a plugin?\n\n### Assistant:\n"
    )
    turns = [*question, {"role": "assistant", "content": "A package."}, {"role": "user", "content": "And?"}]
    assert tokenizer.apply_chat_template(turns, tokenize=False) == (
        "</s>### User:\nWhat is a plugin?\n\n### Assistant:\nA package.</s>\n\n### User:\nAnd?\n\n"
    )


def test_a_chat_answer_comes_from_the_docs_and_stops(demo_llm):
    prompt = demo_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is a plugin?"}], add_generation_prompt=True
    )["input_ids"]
    out = demo_llm.generate([prompt], SamplingParams(max_tokens=120, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert corpus_word_share(out.text) >= 0.8 and longest_corpus_run(out.text) >= 5, out.text


# -- the training script --------------------------------------------------------------------


def test_training_into_a_fresh_directory_uses_the_shipped_corpus(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), "--out", str(out), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"{out} had no corpus.txt: training on a copy of the shipped one")
    assert (out / "corpus.txt").read_bytes() == (DEMO / "corpus.txt").read_bytes()
    verify_demo_model(out)  # its manifest covers what it wrote, the corpus included


def test_training_without_any_corpus_says_what_to_do(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("train_demo_model", TRAIN_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "DEFAULT_OUT", tmp_path / "nothing shipped")
    with pytest.raises(SystemExit, match=r"no corpus\.txt in .*, and the shipped one .* is missing: run with "):
        script.read_corpus(tmp_path / "out")
