"""The demo model ``pluginhost generate`` uses when no ``--model`` is given.

A small OPT trained by ``scripts/train_demo_model.py`` on pluginhost's own documentation
(README, docs, docstrings; the snapshot is ``demo_model/corpus.txt``) and shipped inside the
package, with its tokenizer and a chat template: it works offline and writes words from
those docs. It knows nothing else. ``demo_model/TRAINING.md`` says how it was made.

Nothing is created or downloaded at run time. ``ensure_demo_model`` checks the shipped files
against their recorded SHA-256 sums (``demo_model/SHA256SUMS``, written by the training
script) on every call, since a damaged install would otherwise generate quiet nonsense.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pluginhost.errors import ConfigError

__all__ = ["MANIFEST_NAME", "demo_model_path", "ensure_demo_model", "verify_demo_model"]

#: The manifest in the demo model directory: ``<sha256 hex>  <file name>`` per line (``sha256sum`` format).
MANIFEST_NAME = "SHA256SUMS"


def demo_model_path() -> Path:
    """Where the demo model is installed: the ``demo_model`` directory of this package."""
    return Path(__file__).resolve().with_name("demo_model")


def verify_demo_model(path: Path | str) -> None:
    """Check every file ``path``'s manifest lists against its recorded SHA-256.

    Raises ``ConfigError`` naming the first missing or changed file (or a missing or
    malformed manifest), and saying to reinstall pluginhost. Files the manifest does not
    list are not looked at.
    """
    path = Path(path)
    manifest = path / MANIFEST_NAME
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise _corrupt(path, f"its manifest {MANIFEST_NAME} cannot be read ({exc.strerror or exc})") from None
    expected: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or "/" in name or "\\" in name:
            raise _corrupt(path, f"line {number} of {MANIFEST_NAME} is not '<sha256>  <file name>': {line!r}")
        expected[name] = digest.lower()
    if not expected:
        raise _corrupt(path, f"{MANIFEST_NAME} lists no files")
    for name, digest in expected.items():
        try:
            actual = hashlib.sha256((path / name).read_bytes()).hexdigest()
        except OSError as exc:
            raise _corrupt(path, f"{name} cannot be read ({exc.strerror or exc})") from None
        if actual != digest:
            raise _corrupt(path, f"{name} has SHA-256 {actual[:16]}..., expected {digest[:16]}...")


def ensure_demo_model() -> Path:
    """The installed demo model directory, after checking its files (``ConfigError`` if they are damaged)."""
    path = demo_model_path()
    verify_demo_model(path)
    return path


def _corrupt(path: Path, detail: str) -> ConfigError:
    return ConfigError(
        f"The installed demo model is corrupt: {detail} (in {path}). Reinstall pluginhost "
        "(pip install --force-reinstall pluginhost) to restore it, or pass --model DIR to use another model."
    )
