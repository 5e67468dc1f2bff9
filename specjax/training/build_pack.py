"""What leaves a build machine that hands back only a few small files (`LIMITS`: at most 8 files
of at most 15 MiB, 60 MiB in all): `pack` writes them, `unpack` restores them.

A pack directory holds
    PACK.json           the manifest: every file's bytes and sha256, the tar's parts in order
    BUILD.json          the build's record (every stage's time, steps, samples, tokens/s)
    answers.jsonl.gz    the answers (the seed artifact's rows, then the newly regenerated ones)
    build.tar.NN        one tar, cut in parts of at most the file limit: the shipped drafters
                        (lean exports: no frozen target tensors, with training.json and
                        calibration), split.json, prompts/heldout.jsonl and every drafter's
                        training log (logs/<name>/metrics.jsonl) and learning curve
                        (logs/<name>/learning_curve.jsonl)
A pack over the limits is refused before anything is written, naming the limit.

`unpack` checks every file against PACK.json, then puts the drafters, split.json and held-out
prompts in the output directory (the shipped layout), the answers in `<out>/regen/` (the
committed artifact), the logs in `<work>/logs/`, and merges the record into `<out>/BUILD.json`:
`drafter_builds` (which machine built each drafter, with which command) take the packed
entries, and the packed record is kept whole as `unpacked_build`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from typing import TYPE_CHECKING, Any

from specjax.eval.curve import CURVE_LOG
from specjax.io import read_jsonl, write_json_atomic
from specjax.training.answers import ANSWERS_NAME, read_answers, write_answers
from specjax.training.build_outputs import BuildError, dir_bytes
from specjax.training.build_record import RECORD_NAME, load_record

if TYPE_CHECKING:
    from specjax.training.build_plan import BuildSettings

PACK_NAME = "PACK.json"
TAR_NAME = "build.tar"
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class PackLimits:
    """What the machine hands back."""

    files: int = 8
    file_bytes: int = 15 * MIB
    total_bytes: int = 60 * MIB


LIMITS = PackLimits()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def merged_answers(s: "BuildSettings") -> list[dict[str, Any]]:
    """The seed artifact's rows, then the regenerated rows of prompts it did not answer."""
    base = read_answers(s.seed_answers) if s.seed_answers else []
    have = {json.dumps(r["id"]) for r in base}
    new = [r for r in read_jsonl(s.regen_out, objects=True, repair_torn_tail=True, missing_ok=True)
           if json.dumps(r["id"]) not in have]
    return base + new


def _tar_bytes(s: "BuildSettings") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        drafters = os.path.join(s.out_dir, "drafters")
        for name in sorted(os.listdir(drafters)) if os.path.isdir(drafters) else []:
            if not name.endswith(".tmp"):
                tar.add(os.path.join(drafters, name), arcname=f"drafters/{name}")
        for rel in ("split.json", os.path.join("prompts", "heldout.jsonl")):
            if os.path.isfile(os.path.join(s.out_dir, rel)):
                tar.add(os.path.join(s.out_dir, rel), arcname=rel.replace(os.sep, "/"))
        for name in s.drafters:
            for log in ("metrics.jsonl", CURVE_LOG):
                path = os.path.join(s.run_dir(name), "logs", log)
                if os.path.isfile(path):
                    tar.add(path, arcname=f"logs/{name}/{log}")
    return buf.getvalue()


def pack(s: "BuildSettings", dest: str, *, limits: PackLimits = LIMITS) -> dict[str, Any]:
    """Write the pack of build `s` to directory `dest` (module docstring); returns the manifest.
    BuildError naming the limit when the files would not fit it (nothing written then)."""
    record = os.path.join(s.out_dir, RECORD_NAME)
    if not os.path.isfile(record):
        raise BuildError(f"--pack: no build record {record} (run the build first)")
    files: dict[str, bytes] = {}
    with open(record, "rb") as f:
        files[RECORD_NAME] = f.read()
    answers = merged_answers(s)
    if answers:
        tmp = os.path.join(s.work_dir, ANSWERS_NAME)
        write_answers(tmp, answers)
        with open(tmp, "rb") as f:
            files[ANSWERS_NAME] = f.read()
    tar = _tar_bytes(s)
    parts = [tar[i: i + limits.file_bytes] for i in range(0, max(len(tar), 1), limits.file_bytes)]
    for i, part in enumerate(parts):
        files[f"{TAR_NAME}.{i:02d}"] = part
    manifest = {"files": {n: {"bytes": len(b), "sha256": _sha256(b)} for n, b in files.items()},
                "tar_parts": [f"{TAR_NAME}.{i:02d}" for i in range(len(parts))],
                "answers_rows": len(answers)}
    files[PACK_NAME] = json.dumps(manifest, indent=1).encode("utf-8")
    big = {n: len(b) for n, b in files.items() if len(b) > limits.file_bytes}
    if big:
        raise BuildError(f"--pack: {', '.join(f'{n} ({b / MIB:.1f} MiB)' for n, b in big.items())} "
                         f"over the limit of {limits.file_bytes} bytes "
                         f"({limits.file_bytes / MIB:g} MiB) per file")
    if len(files) > limits.files:
        raise BuildError(f"--pack: {len(files)} files, over the limit of {limits.files} files "
                         f"({', '.join(files)})")
    total = sum(len(b) for b in files.values())
    if total > limits.total_bytes:
        raise BuildError(f"--pack: {total} bytes ({total / MIB:.1f} MiB) in all, over the limit "
                         f"of {limits.total_bytes} bytes ({limits.total_bytes / MIB:g} MiB) in all")
    os.makedirs(dest, exist_ok=True)
    for n, b in files.items():
        with open(os.path.join(dest, n), "wb") as f:
            f.write(b)
    return manifest


def _read_pack(src: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    path = os.path.join(src, PACK_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise BuildError(f"--unpack: {src} has no {PACK_NAME} (not a pack directory)") from None
    except json.JSONDecodeError as e:
        raise BuildError(f"--unpack: {path}: invalid JSON ({e})") from None
    files = {}
    for name, want in manifest["files"].items():
        p = os.path.join(src, name)
        if not os.path.isfile(p):
            raise BuildError(f"--unpack: {p} is missing")
        with open(p, "rb") as f:
            data = f.read()
        if _sha256(data) != want["sha256"]:
            raise BuildError(f"--unpack: {p} does not match its sha256 in {PACK_NAME} "
                             "(truncated or changed)")
        files[name] = data
    return manifest, files


def _safe_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    out = []
    for m in tar.getmembers():
        parts = m.name.split("/")
        if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
            raise BuildError(f"--unpack: unsafe member {m.name!r} in the pack's tar")
        out.append(m)
    return out


def unpack(s: "BuildSettings", src: str) -> dict[str, Any]:
    """Restore pack directory `src` into build `s`'s output and work directories (module
    docstring); returns what was restored."""
    manifest, files = _read_pack(src)
    tar_bytes = b"".join(files[n] for n in manifest["tar_parts"])
    restored: dict[str, Any] = {"drafters": []}
    with tempfile.TemporaryDirectory(dir=s.work_dir if os.path.isdir(s.work_dir) else None) as tmp:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r") as tar:
            tar.extractall(tmp, members=_safe_members(tar))
        if ANSWERS_NAME in files:
            staged = os.path.join(tmp, ANSWERS_NAME)
            with open(staged, "wb") as f:
                f.write(files[ANSWERS_NAME])
            restored["answers_rows"] = len(read_answers(staged))  # checked before it replaces
            dst = os.path.join(s.out_dir, "regen", ANSWERS_NAME)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(staged, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
        drafters = os.path.join(tmp, "drafters")
        for name in sorted(os.listdir(drafters)) if os.path.isdir(drafters) else []:
            dst = os.path.join(s.out_dir, "drafters", name)
            shutil.rmtree(dst + ".tmp", ignore_errors=True)
            shutil.copytree(os.path.join(drafters, name), dst + ".tmp")
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(dst + ".tmp", dst)
            restored["drafters"].append(name)
        for rel in ("split.json", os.path.join("prompts", "heldout.jsonl")):
            if os.path.isfile(os.path.join(tmp, rel)):
                os.makedirs(os.path.dirname(os.path.join(s.out_dir, rel)), exist_ok=True)
                shutil.copyfile(os.path.join(tmp, rel), os.path.join(s.out_dir, rel))
        logs = os.path.join(tmp, "logs")
        if os.path.isdir(logs):
            shutil.copytree(logs, os.path.join(s.work_dir, "logs"), dirs_exist_ok=True)
    packed = json.loads(files[RECORD_NAME])
    record = load_record(os.path.join(s.out_dir, RECORD_NAME))
    record.setdefault("drafter_builds", {}).update(packed.get("drafter_builds", {}))
    record["unpacked_build"] = packed
    shipped = os.path.join(s.out_dir, "drafters")
    record["drafter_bytes"] = {n: dir_bytes(os.path.join(shipped, n))
                               for n in sorted(os.listdir(shipped))}
    record["drafter_bytes_total"] = sum(record["drafter_bytes"].values())
    write_json_atomic(os.path.join(s.out_dir, RECORD_NAME), record)
    return restored


__all__ = ["LIMITS", "PACK_NAME", "PackLimits", "merged_answers", "pack", "unpack"]
