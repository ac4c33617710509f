"""Train pluginhost's demo model: a small OPT that has read the project's own documentation.

Usage (from the repository root, with torch, transformers, tokenizers and jinja2 installed)::

    python scripts/train_demo_model.py                      # train from the committed corpus
    python scripts/train_demo_model.py --snapshot-corpus    # first re-read the docs into corpus.txt

The training text is ``pluginhost/demo_model/corpus.txt``, a committed snapshot of README.md,
docs/*.md, the sample plugins' READMEs, the hook specs' docstrings and the modules' docstrings,
with code blocks dropped and tables flattened. The README's "The demo model" paragraph and
``pluginhost/demo.py`` are left out: they describe this very model, so the text it learns must
not depend on its results. Training reads only corpus.txt, so a run is reproducible however the
docs change later; ``--snapshot-corpus`` refreshes it on purpose. It reads ``OUT/corpus.txt``: an
``--out`` directory without one gets a copy of the shipped corpus first, so that it holds, and its
manifest hashes, the text its model learnt.

Everything that decides the result is fixed here: the seed, the thread count, the
hyper-parameters, the data order (a seeded shuffle per epoch) and the step count (never the
wall clock). Two runs with the same torch on the same machine write byte-identical model,
tokenizer and config files (``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``); other CPUs or torch builds may round differently.
``TRAINING.md`` records the command and the run's times, so it differs from run to run, and with it
its line in ``SHA256SUMS``. The run writes into ``--out`` (default ``pluginhost/demo_model``):

* ``config.json``, ``model.safetensors`` (float16; the tied ``lm_head`` is not stored);
* ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, and the chat template);
* ``TRAINING.md``: the command, seed, hyper-parameters, losses, time, versions and samples;
* ``SHA256SUMS``, the manifest of every other file, which ``pluginhost.demo`` checks on use.

Besides the plain text, it trains on chat examples derived mechanically from the corpus: each
section's heading, phrased as a question, is the user's turn and the section's first sentences
are the assistant's, so the chat template gets answers in the docs' own words.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import random
import re
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from transformers import OPTForCausalLM, PreTrainedTokenizerBase

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's pluginhost, whatever else is installed

from pluginhost.demo import MANIFEST_NAME  # noqa: E402 - needs the path above

DEFAULT_OUT = REPO / "pluginhost" / "demo_model"
CORPUS_NAME = "corpus.txt"

#: Marks where each source starts in corpus.txt; not training text itself.
SOURCE_MARK = re.compile(r"^<<< (.+) >>>$", flags=re.MULTILINE)

#: A "### User:" / "### Assistant:" template; the answer ends with </s>, so generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}### Assistant:\n{{ message['content'] }}{{ eos_token }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3, as in OPT
BOS_ID = EOS_ID = 2  # OPT starts every text with </s> and ends it with </s>
PAD_ID = 1


@dataclass(frozen=True)
class Hyper:
    """Everything that decides the trained weights, given corpus.txt.

    The size keeps the weights at 3.2 MB in float16 and a step at about 0.34 s on 2 cores, so the
    whole run takes under three minutes; the docs are learnt almost by heart well before the end.
    """

    seed: int = 20240601
    threads: int = 2
    vocab_size: int = 2048
    hidden_size: int = 160
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    ffn_dim: int = 640
    max_position_embeddings: int = 256
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 450
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup: int = 30
    weight_decay: float = 0.01
    dropout: float = 0.0  # 0.1 gave a higher train and held-out loss at this budget, and worse text
    grad_clip: float = 1.0
    holdout_every: int = 16  # every 16th section is held out, to measure loss on unseen text
    log_every: int = 25


#: What TRAINING.md shows the model writing: plain prompts, then chat questions.
SAMPLE_PROMPTS = ("Hello, my name is", "A plugin is", "The engine")
SAMPLE_QUESTIONS = ("What is a plugin?", "What does the pre_load hook do?", "Tell me about choosing plugins.")


# -- the corpus snapshot ----------------------------------------------------------------------------


def snapshot_corpus(repo: Path = REPO) -> str:
    """The training text, re-read from the repository's prose (what ``--snapshot-corpus`` writes)."""
    parts: list[tuple[str, str]] = []
    readme = _drop_paragraph((repo / "README.md").read_text(encoding="utf-8"), "**The demo model.**")
    parts.append(("README.md", clean_markdown(readme)))
    for doc in sorted((repo / "docs").glob("*.md")):
        parts.append((doc.relative_to(repo).as_posix(), clean_markdown(doc.read_text(encoding="utf-8"))))
    for plugin_readme in sorted((repo / "sample_plugins").glob("*/README.md")):
        parts.append((plugin_readme.relative_to(repo).as_posix(), clean_markdown(plugin_readme.read_text("utf-8"))))
    parts.append(("hookspecs/__init__.py", _hookspec_docs(repo / "hookspecs" / "__init__.py")))
    modules = sorted([*(repo / "pluginhost").rglob("*.py"), *(repo / "builtin_models").glob("*.py")])
    # demo.py describes this very model (see above); pluginhost.testing's docstrings repeat the
    # README's fixture list, and talk about random test models.
    docs = [_module_doc(path, repo) for path in modules if path.name != "demo.py" and "testing" not in path.parts]
    parts.append(("module docstrings", "\n\n".join(d for d in docs if d)))
    return "\n".join(f"<<< {name} >>>\n{text.strip()}\n" for name, text in parts)


def _drop_paragraph(text: str, opening: str) -> str:
    """``text`` without the paragraph that starts with ``opening`` (up to the next blank line)."""
    return re.sub(rf"^{re.escape(opening)}.*?(\n\s*\n|\Z)", "", text, flags=re.MULTILINE | re.DOTALL)


def clean_markdown(text: str) -> str:
    """Prose only: fenced code blocks dropped, tables flattened to "cell: cell." lines, links unwrapped."""
    text = re.sub(r"^```.*?^```[ \t]*\n?", "", text, flags=re.MULTILINE | re.DOTALL)
    lines = []
    for line in text.splitlines():
        if re.fullmatch(r"\|?\s*:?-{3,}.*", line.strip()):
            continue  # a table's header rule
        if line.lstrip().startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            line = ": ".join(c for c in cells if c) + "."
        lines.append(re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", line))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _strip_literal_blocks(doc: str) -> str:
    """A docstring without its ``Example::`` / ``>>>`` code: the prose around it stays."""
    out: list[str] = []
    skipping = False
    for line in doc.splitlines():
        if skipping and (not line.strip() or line.startswith("    ")):
            continue
        skipping = False
        if line.rstrip().endswith("::"):
            head = line.rstrip()[:-2].rstrip()
            if head and not head.lower().endswith("example"):
                out.append(head + ":")
            skipping = True
            continue
        if line.lstrip().startswith(">>>"):
            continue
        out.append(line)
    # reST's ``literal`` reads as Markdown's `literal`: one spelling for the model to learn.
    return re.sub(r"``([^`]+)``", r"`\1`", "\n".join(out)).strip()


def _hookspec_docs(path: Path) -> str:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    sections = [f"# The hook specifications\n\n{_strip_literal_blocks(ast.get_docstring(tree) or '')}"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
            args = ", ".join(a.arg for a in node.args.args)
            sections.append(f"## The `{node.name}({args})` hook\n\n{_strip_literal_blocks(doc)}")
    return "\n\n".join(sections)


def _module_doc(path: Path, repo: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        return ""
    module = ".".join(path.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
    return f"## The `{module}` module\n\n{_strip_literal_blocks(doc)}"


# -- sections, and chat examples from them ------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    heading: str  # without the leading #s; "" for text before the first heading
    body: str

    @property
    def text(self) -> str:
        return f"{self.heading}\n\n{self.body}".strip() if self.heading else self.body


def split_sections(corpus: str) -> list[Section]:
    """The corpus cut at every markdown heading, source marks removed."""
    sections: list[Section] = []
    for chunk in SOURCE_MARK.split(corpus)[2::2]:  # [before, name, text, name, text, ...]
        heading, body = "", []
        for line in chunk.splitlines():
            match = re.match(r"^#{1,6} (.+)$", line)
            if match:
                if heading or "".join(body).strip():
                    sections.append(Section(heading, "\n".join(body).strip()))
                heading, body = match.group(1).strip(), []
            else:
                body.append(line)
        if heading or "".join(body).strip():
            sections.append(Section(heading, "\n".join(body).strip()))
    return [s for s in sections if s.body]


def questions_for(heading: str) -> list[str]:
    """A few ways a user might ask about a section, derived from its heading alone."""
    h = re.sub(r"^\d+\.\s*", "", heading).strip()
    h = h.split(": ")[0] if h.startswith("`") else h  # "`pre_load(config, model_class)`: inspect..." -> the hook
    asks = [h, f"Tell me about {h[0].lower() + h[1:] if not h.startswith('`') else h}."]
    what_is = re.fullmatch(r"What (an? |the )?(.+) is", h)
    if what_is:
        asks.append(f"What is {what_is.group(1) or ''}{what_is.group(2)}?")
    hook = re.fullmatch(r"The `(\w+)\(.*\)` hook|`(\w+)\(.*\)`", h)
    if hook:
        asks.append(f"What does the {hook.group(1) or hook.group(2)} hook do?")
    module = re.fullmatch(r"The `([\w.]+)` module", h)
    if module:
        asks.append(f"What does {module.group(1)} do?")
    return asks


def first_sentences(body: str, limit: int = 320) -> str:
    """The section's opening prose, whole sentences up to about ``limit`` characters."""
    prose = re.sub(r"\s+", " ", body).strip()
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`*(])", prose)
    answer = ""
    for sentence in sentences:
        if answer and len(answer) + len(sentence) > limit:
            break
        answer = f"{answer} {sentence}".strip()
    return answer


def chat_examples(sections: list[Section]) -> list[list[dict[str, str]]]:
    """One conversation per (section, question), the answer in the section's own words."""
    conversations = []
    for section in sections:
        if not section.heading:
            continue
        answer = first_sentences(section.body)
        if len(answer) < 20:
            continue
        for question in questions_for(section.heading):
            conversations.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    return conversations


# -- tokenizer --------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int, out: Path) -> None:
    """A byte-level BPE like OPT's (specials <s> <pad> </s> <unk> = 0..3, </s> prefixed), saved in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", BOS_ID)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="</s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
    wrapped.save_pretrained(out)
    _portable_tokenizer_config(out)


def _portable_tokenizer_config(out: Path) -> None:
    """Put the chat template in tokenizer_config.json and name a class every transformers >= 4.45 knows.

    transformers 5 would write the template to chat_template.jinja (older versions read only the
    JSON key) and name its own ``TokenizersBackend`` class, which 4.x lacks.
    """
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").unlink(missing_ok=True)


# -- training ---------------------------------------------------------------------------------------


def render_chat(conversation: list[dict[str, str]]) -> str:
    """A finished conversation as the chat template writes it, ending with the answer's ``</s>``."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(CHAT_TEMPLATE)
    return template.render(messages=conversation, bos_token="</s>", eos_token="</s>").rstrip()


def encode_units(tokenizer: PreTrainedTokenizerBase, texts: list[str], chats: list[str]) -> list[list[int]]:
    """Plain texts as ``</s> text </s>`` (OPT's BOS, and an end the model learns to stop at); rendered
    chats as they are, since the template already writes both ``</s>``."""
    # The backend tokenizer, because the wrapper warns about units longer than the model's positions.
    backend = tokenizer.backend_tokenizer
    plain = [backend.encode(t).ids + [EOS_ID] for t in texts]
    return plain + [backend.encode(c, add_special_tokens=False).ids for c in chats]


def batches(units: list[list[int]], hp: Hyper, rng: random.Random) -> Iterator[torch.Tensor]:
    """Endless (batch_size, seq_len) windows: each epoch, the units shuffled, joined and cut."""
    import torch

    pending: list[list[int]] = []
    while True:
        order = list(range(len(units)))
        rng.shuffle(order)
        stream = [t for i in order for t in units[i]]
        start = rng.randrange(hp.seq_len)  # epochs cut at different places
        for s in range(start, len(stream) - hp.seq_len + 1, hp.seq_len):
            pending.append(stream[s : s + hp.seq_len])
            if len(pending) == hp.batch_size:
                yield torch.tensor(pending)
                pending = []


def lr_at(step: int, hp: Hyper) -> float:
    """Linear warm-up, then a cosine decay to ``min_lr``."""
    if step < hp.warmup:
        return hp.lr * (step + 1) / hp.warmup
    progress = (step - hp.warmup) / max(1, hp.steps - hp.warmup)
    return hp.min_lr + 0.5 * (hp.lr - hp.min_lr) * (1 + math.cos(math.pi * progress))


def mean_loss(model: OPTForCausalLM, units: list[list[int]], seq_len: int) -> float:
    """Token-weighted loss over ``units``, each scored alone (cut into seq_len windows)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids in units:
            for s in range(0, len(ids) - 1, seq_len):
                window = torch.tensor([ids[s : s + seq_len]])
                if window.shape[1] < 2:
                    continue
                out = model(window, labels=window)
                n = window.shape[1] - 1
                total += out.loss.item() * n
                count += n
    return total / max(count, 1)


def greedy(model: OPTForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], max_new: int) -> str:
    """The decoded greedy continuation of ``prompt_ids``, stopping at ``</s>``."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )
    return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)


def sha256_manifest(out: Path, names: list[str]) -> str:
    """``sha256sum``'s format: ``<hex>  <name>`` per line."""
    return "".join(f"{hashlib.sha256((out / n).read_bytes()).hexdigest()}  {n}\n" for n in sorted(names))


@dataclass
class Data:
    """The tokenized training and held-out text, and counts for the report."""

    units: list[list[int]]
    held_units: list[list[int]]
    summary: str


def prepare(corpus: str, hp: Hyper, out: Path) -> tuple[PreTrainedTokenizerBase, Data]:
    """Train and save the tokenizer, and tokenize the corpus's sections and chat examples with it."""
    from transformers import AutoTokenizer

    sections = split_sections(corpus)
    held = [s for i, s in enumerate(sections) if i % hp.holdout_every == hp.holdout_every - 1]
    kept = [s for s in sections if s not in held]
    conversations = chat_examples(kept)
    chats = [render_chat(c) for c in conversations]
    train_tokenizer([s.text for s in kept] + chats, hp.vocab_size, hp.max_position_embeddings, out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # as users will load it, template included
    if tokenizer.apply_chat_template(conversations[0], tokenize=False).rstrip() != chats[0]:
        raise RuntimeError("the saved chat template renders differently from the one trained on")
    units = encode_units(tokenizer, [s.text for s in kept], chats)
    held_units = encode_units(tokenizer, [s.text for s in held], [])
    n_plain = sum(len(u) for u in units[: len(kept)])
    n_chat = sum(len(u) for u in units[len(kept) :])
    summary = (
        f"{len(corpus):,} characters; {n_plain:,} tokens of plain text in {len(kept)} sections and "
        f"{n_chat:,} tokens in {len(conversations)} chat examples; {len(held)} sections "
        f"({sum(map(len, held_units)):,} tokens) held out"
    )
    return tokenizer, Data(units, held_units, summary)


def train(data: Data, vocab_size: int, hp: Hyper) -> tuple[OPTForCausalLM, list[float], list[float]]:
    """An OPT trained on ``data.units`` for ``hp.steps`` steps: the model (in eval mode), and each step's
    loss and duration in seconds."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=vocab_size,
        hidden_size=hp.hidden_size,
        num_hidden_layers=hp.num_hidden_layers,
        ffn_dim=hp.ffn_dim,
        num_attention_heads=hp.num_attention_heads,
        max_position_embeddings=hp.max_position_embeddings,
        word_embed_proj_dim=hp.hidden_size,
        do_layer_norm_before=True,
        dropout=hp.dropout,
        attention_dropout=hp.dropout,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    model = OPTForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    params = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},  # biases, LayerNorms
        ],
        lr=hp.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    losses: list[float] = []
    durations: list[float] = []
    data_iter = batches(data.units, hp, random.Random(hp.seed))
    began = time.perf_counter()
    for step in range(hp.steps):
        step_began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, hp)
        batch = next(data_iter)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        durations.append(time.perf_counter() - step_began)
        if (step + 1) % hp.log_every == 0 or step == 0:
            recent = losses[-hp.log_every :]
            print(
                f"step {step + 1:4d}/{hp.steps}  loss {sum(recent) / len(recent):.3f}  "
                f"lr {lr_at(step, hp):.2e}  {time.perf_counter() - began:5.0f} s",
                flush=True,
            )
    return model.eval(), losses, durations


def read_corpus(out: Path, *, snapshot: bool = False) -> str:
    """The training text, ``out/corpus.txt``: first re-read from the docs if ``snapshot``, else copied from the
    shipped corpus (``DEFAULT_OUT``) when ``out`` has none; ``SystemExit`` saying what to do if neither exists."""
    target, shipped = out / CORPUS_NAME, DEFAULT_OUT / CORPUS_NAME
    if snapshot:
        target.write_text(snapshot_corpus(), encoding="utf-8")
    elif not target.is_file():
        if not shipped.is_file():
            raise SystemExit(
                f"error: no {CORPUS_NAME} in {out}, and the shipped one ({shipped}) is missing: "
                f"run with --snapshot-corpus to re-read the docs into {target}"
            )
        shutil.copyfile(shipped, target)  # OUT then holds, and its manifest hashes, the text it was trained on
        print(f"{out} had no {CORPUS_NAME}: training on a copy of the shipped one ({shipped})", flush=True)
    return target.read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    parser.add_argument("--snapshot-corpus", action="store_true", help="re-read the docs into OUT/corpus.txt first")
    parser.add_argument("--steps", type=int, default=Hyper.steps, help="training steps (default: %(default)s)")
    args = parser.parse_args(argv)
    hp = Hyper(steps=args.steps)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    corpus = read_corpus(out, snapshot=args.snapshot_corpus)

    import torch
    import transformers

    torch.manual_seed(hp.seed)
    torch.set_num_threads(hp.threads)
    began = time.perf_counter()
    tokenizer, data = prepare(corpus, hp, out)
    print(f"corpus: {data.summary}; vocabulary: {len(tokenizer)}", flush=True)
    model, losses, durations = train(data, len(tokenizer), hp)
    seconds = time.perf_counter() - began

    # What ships is float16: measure the losses, and sample, on exactly those weights.
    model = model.half().float()
    train_loss = mean_loss(model, data.units, hp.seq_len)
    held_loss = mean_loss(model, data.held_units, hp.seq_len)
    print(f"final loss (float16 weights): train {train_loss:.3f}, held out {held_loss:.3f}", flush=True)
    model.config.dtype = "float16"
    model.half().save_pretrained(out)
    model.float()

    samples = {prompt: greedy(model, tokenizer, tokenizer(prompt)["input_ids"], 40) for prompt in SAMPLE_PROMPTS}
    for question in SAMPLE_QUESTIONS:
        chat = [{"role": "user", "content": question}]
        prompt_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
        samples[f"chat: {question}"] = greedy(model, tokenizer, prompt_ids, 80)
    for prompt, text in samples.items():
        print(f"{prompt!r} -> {text!r}")

    report = Report(
        hp=hp,
        command=" ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        versions=f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        data=data.summary,
        n_params=sum(p.numel() for p in model.parameters()),
        size=(out / "model.safetensors").stat().st_size,
        seconds=seconds,
        median_step=statistics.median(durations),
        train_loss=train_loss,
        held_loss=held_loss,
        losses=losses,
        samples=samples,
    )
    (out / "TRAINING.md").write_text(report.markdown(), encoding="utf-8")
    # Last, so it covers everything above: pluginhost.demo checks every file it lists.
    shipped = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    (out / MANIFEST_NAME).write_text(sha256_manifest(out, shipped), encoding="utf-8")
    print(f"{seconds:.0f} s; wrote {', '.join(shipped)} and {MANIFEST_NAME} into {out}")
    return 0


@dataclass(frozen=True)
class Report:
    """What TRAINING.md records about one run."""

    hp: Hyper
    command: str
    versions: str
    data: str
    n_params: int
    size: int
    seconds: float
    median_step: float
    train_loss: float
    held_loss: float
    losses: list[float]
    samples: dict[str, str]

    def markdown(self) -> str:
        hp = self.hp
        every = hp.log_every * 4
        curve = ", ".join(
            f"{i + hp.log_every}: {sum(self.losses[i : i + hp.log_every]) / hp.log_every:.2f}"
            for i in range(0, len(self.losses) - hp.log_every + 1, every)
        )
        hyper = "\n".join(f"| `{k}` | {v} |" for k, v in asdict(hp).items())
        samples = "\n".join(f"* `{p}` → {json.dumps(t.strip(), ensure_ascii=False)}" for p, t in self.samples.items())
        return f"""# How the demo model was trained

Written by `scripts/train_demo_model.py` at the end of its run; rerun it rather than edit this.

* Command (repository root): `{self.command}`, with {self.versions}.
* Text: `corpus.txt`, {self.data}.
* Model: OPT, {hp.num_hidden_layers} layers, hidden size {hp.hidden_size}, {hp.num_attention_heads} heads,
  FFN {hp.ffn_dim}, {hp.max_position_embeddings} positions, {self.n_params / 1e6:.2f}M parameters, stored as
  float16 ({self.size / 1e6:.1f} MB); byte-level BPE vocabulary of {hp.vocab_size}.
* Training: {hp.steps} steps of {hp.batch_size} x {hp.seq_len} tokens, AdamW, seed {hp.seed};
  {self.seconds:.0f} s on {hp.threads} CPU threads, tokenizer included (median step {self.median_step:.2f} s:
  about {self.median_step * hp.steps:.0f} s of training on an otherwise idle machine).
* Final loss (cross-entropy per token, nats, on the float16 weights): **train {self.train_loss:.3f}**;
  on the held-out sections {self.held_loss:.3f}: it learnt these docs, not the language.
* Training loss at step (mean of the last {hp.log_every} steps): {curve}.

Hyper-parameters (`Hyper` in the script):

| name | value |
| --- | --- |
{hyper}

Greedy samples (transformers' `generate`, in float32 from the shipped float16 weights):

{samples}
"""


if __name__ == "__main__":
    raise SystemExit(main())
