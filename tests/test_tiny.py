"""cegppo_trl.tiny_model (builtin:tiny): local tokenizer/model, save/load through the Auto classes, SFT warm start."""

from __future__ import annotations

import json

import pytest
import torch

from cegppo_trl.data import make_arithmetic_rows
from cegppo_trl.rewards import extract_answer
from cegppo_trl.tiny_model import (
    CHAT_TEMPLATE,
    PROMPT_INSTRUCTION,
    arithmetic_sft_examples,
    build_tiny_model,
    build_tiny_tokenizer,
    format_user_message,
    save_tiny,
    sft_dataset,
    sft_warmstart,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a busy 2-core machine runs one thread faster

PROBLEM = "What is 23+41?"
TEXTS = [
    format_user_message(PROBLEM),
    "23+41=64. \\boxed{64}",
    "Hello wörld  \n\n x = 3.14159, ünïcödé 日本語 \t tabs <|im_end|> 1234567890",
]


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer)


def _chat_ids(tok, problem=PROBLEM):
    msgs = [{"role": "user", "content": format_user_message(problem)}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def _completion_ids(tok, completion):
    return tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_tokenizer_basics(tiny_tokenizer):
    assert 256 < len(tiny_tokenizer) <= 600
    assert tiny_tokenizer.unk_token is None
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token is not None and tiny_tokenizer.pad_token_id != tiny_tokenizer.eos_token_id
    for d in "0123456789":
        assert len(tiny_tokenizer(d, add_special_tokens=False)["input_ids"]) == 1
    ids = tiny_tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.convert_ids_to_tokens(ids) == list("12345")  # digits are never merged
    for text in TEXTS:  # lossless, no BOS/EOS added implicitly
        ids = tiny_tokenizer(text)["input_ids"]
        assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer(TEXTS[0])["input_ids"] == tiny_tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert build_tiny_tokenizer().get_vocab() == tiny_tokenizer.get_vocab()  # deterministic


def test_chat_template(tiny_tokenizer):
    msgs = [{"role": "user", "content": format_user_message(PROBLEM)}]
    text = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (f"<|im_start|>user\n{PROBLEM} {PROMPT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert no_gen == f"<|im_start|>user\n{PROBLEM} {PROMPT_INSTRUCTION}<|im_end|>\n"
    # TRL's GRPOTrainer call: batched, tokenize=True, return_dict=True
    out = tiny_tokenizer.apply_chat_template([msgs, msgs], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert out["input_ids"][0] == out["input_ids"][1] == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.convert_ids_to_tokens(out["input_ids"][0][:1]) == ["<|im_start|>"]
    assert "<|im_start|>" in tiny_tokenizer.convert_ids_to_tokens(out["input_ids"][0])
    # special tokens are skipped when decoding completions (TRL decodes with skip_special_tokens=True)
    comp = tiny_tokenizer("\\boxed{64}", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert tiny_tokenizer.decode(comp, skip_special_tokens=True) == "\\boxed{64}"


def test_save_load_auto(model, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved_dir = save_tiny(model, tiny_tokenizer, tmp_path)
    tok2 = AutoTokenizer.from_pretrained(saved_dir, local_files_only=True)  # with the model's config.json
    assert tok2.get_vocab() == tiny_tokenizer.get_vocab()
    assert len(tok2) == len(tiny_tokenizer)
    for attr in ("eos_token", "pad_token", "bos_token", "unk_token", "eos_token_id", "pad_token_id"):
        assert getattr(tok2, attr) == getattr(tiny_tokenizer, attr), attr
    for text in TEXTS:
        assert tok2(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
        assert tok2.decode(tok2(text)["input_ids"]) == text
    assert tok2.chat_template == CHAT_TEMPLATE
    assert _chat_ids(tok2) == _chat_ids(tiny_tokenizer)
    j1, j2 = json.loads(tiny_tokenizer.backend_tokenizer.to_str()), json.loads(tok2.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert j1[key] == j2[key], key
    assert j1["model"]["merges"] == j2["model"]["merges"]
    model2 = AutoModelForCausalLM.from_pretrained(saved_dir, local_files_only=True)
    assert model2.dtype == torch.float32
    sd, sd2 = model.state_dict(), model2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert model2.generation_config.eos_token_id == tiny_tokenizer.eos_token_id
    ids = torch.tensor([_chat_ids(tiny_tokenizer)])
    model.eval(), model2.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model2(ids).logits)


def test_model_size_config_and_determinism(tiny_tokenizer, model):
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.8e6 < n_params < 1.3e6
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert model.config.vocab_size == len(tiny_tokenizer)
    for cfg in (model.config, model.generation_config):
        assert cfg.eos_token_id == tiny_tokenizer.eos_token_id
        assert cfg.pad_token_id == tiny_tokenizer.pad_token_id
        assert cfg.bos_token_id == tiny_tokenizer.bos_token_id
    same = build_tiny_model(tiny_tokenizer, seed=0)
    other = build_tiny_model(tiny_tokenizer, seed=1)
    sd, sd_same, sd_other = model.state_dict(), same.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd_same[k]) for k in sd)
    assert not all(torch.equal(sd[k], sd_other[k]) for k in sd)
    small = build_tiny_model(tiny_tokenizer, hidden_size=64, num_layers=2, intermediate_size=128)
    assert small.config.intermediate_size == 128 and small.config.num_hidden_layers == 2


def test_eos_stops_generation(tiny_tokenizer, model):
    """generate() relies on the model's generation_config: once eos is produced the sequence stops."""
    from transformers import LogitsProcessor, LogitsProcessorList

    eos = tiny_tokenizer.eos_token_id

    class ForceEos(LogitsProcessor):  # row i is forced to emit eos as its (i + 2)-th new token
        def __init__(self, prompt_len):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.prompt_len
            for i in range(scores.shape[0]):
                if step == i + 1:
                    scores[i] = -float("inf")
                    scores[i, eos] = 0.0
                elif step <= i:
                    scores[i, eos] = -float("inf")
            return scores

    ids = torch.tensor([_chat_ids(tiny_tokenizer)] * 2)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=20,
        do_sample=False,
        logits_processor=LogitsProcessorList([ForceEos(ids.shape[1])]),
    )
    new = out[:, ids.shape[1] :]
    assert new.shape[1] == 3  # stopped once every row hit eos, long before max_new_tokens
    assert new[0, 1].item() == eos and new[0, 2].item() == tiny_tokenizer.pad_token_id
    assert new[1, 2].item() == eos and eos not in new[1, :2].tolist()


def test_arithmetic_sft_examples():
    rows = [
        {"problem": "What is 23+41?", "answer": "64"},
        {"problem": "Ann has 49 cards and gives away 27. How many cards are left?", "answer": "22"},
        {"problem": "Compute 2*3.", "answer": 6},
        {"problem": "What is 1.5 plus 2?", "answer": "3.5"},
    ]
    ex = arithmetic_sft_examples(rows)
    assert ex[0] == (f"What is 23+41? {PROMPT_INSTRUCTION}", "23+41=64. \\boxed{64}")
    assert ex[1] == (f"{rows[1]['problem']} {PROMPT_INSTRUCTION}", "49-27=22. \\boxed{22}")
    assert ex[2][1] == "2*3=6. \\boxed{6}"
    assert ex[3][1] == "\\boxed{3.5}"  # no integer equation fits: boxed only
    assert extract_answer(ex[0][1]) == "64" and extract_answer("no box") is None


def test_prompt_masking(tiny_tokenizer, model, tmp_path):
    """SFTTrainer trains on TRL's GRPOTrainer prompt ids, then completion + eos; only completion + eos have labels."""
    from trl import SFTConfig, SFTTrainer

    from cegppo_trl.evaluation.generation import prompt_token_ids

    examples = arithmetic_sft_examples(
        [{"problem": PROBLEM, "answer": "64"}, {"problem": "What is 1+2?", "answer": "3"}]
    )
    args = SFTConfig(
        str(tmp_path), completion_only_loss=True, use_cpu=True, bf16=False, activation_checkpointing=False
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=sft_dataset(tiny_tokenizer, examples), processing_class=tiny_tokenizer
    )
    for (prompt, completion), row in zip(examples, trainer.train_dataset):
        p = prompt_token_ids(tiny_tokenizer, [{"role": "user", "content": prompt}])
        c = _completion_ids(tiny_tokenizer, completion)
        assert row["input_ids"] == p + c and row["labels"] == [-100] * len(p) + c
    assert p == _chat_ids(tiny_tokenizer, "What is 1+2?")
    with pytest.raises(ValueError, match="pairs"):
        sft_dataset(tiny_tokenizer, [])


def test_sft_warmstart_lowers_loss_and_prompt_loss_is_ignored(tiny_tokenizer):
    rows = make_arithmetic_rows(256, seed=0)
    examples = arithmetic_sft_examples(rows)
    m = build_tiny_model(tiny_tokenizer, seed=0)
    stats = sft_warmstart(m, tiny_tokenizer, examples, steps=30, batch_size=32, progress=False)
    assert set(stats) >= {"initial_loss", "final_loss", "seconds", "steps", "examples"}
    assert stats["initial_loss"] > 5.0  # ~ln(vocab) at random init
    assert stats["final_loss"] < stats["initial_loss"] - 2.0
    # The prompt is not trained on: its loss stays high while the completion loss dropped.
    p = _chat_ids(tiny_tokenizer, rows[0]["problem"])
    c = _completion_ids(tiny_tokenizer, examples[0][1])
    ids = torch.tensor([p + c])
    m.eval()
    with torch.no_grad():
        logp = torch.log_softmax(m(ids).logits[0, :-1], -1)
    nll = -logp.gather(1, ids[0, 1:, None])[:, 0]
    prompt_nll, completion_nll = nll[: len(p) - 1].mean().item(), nll[len(p) - 1 :].mean().item()
    assert prompt_nll > completion_nll + 1.0


def test_sft_is_deterministic_and_takes_pairs(tiny_tokenizer):
    rows = make_arithmetic_rows(8, seed=5)
    examples = arithmetic_sft_examples(rows)
    kw = dict(steps=3, batch_size=4, progress=False)
    m1, m2 = build_tiny_model(tiny_tokenizer, seed=0), build_tiny_model(tiny_tokenizer, seed=0)
    s1 = sft_warmstart(m1, tiny_tokenizer, examples, **kw)
    s2 = sft_warmstart(m2, tiny_tokenizer, [list(pair) for pair in examples], **kw)  # lists as pairs: the same run
    assert s1["steps"] == 3 and s1["examples"] == 8
    assert s1["final_loss"] == s2["final_loss"]
    with pytest.raises(ValueError, match="pairs"):
        sft_warmstart(m1, tiny_tokenizer, rows, **kw)  # rows are not examples
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)


# Two "machines" building builtin:tiny into the output_dir they share: each waits for a go file (so that both start
# together, after their imports), builds with warm_tiny and prints whether it found the other's build.
_MACHINE = """
import json, os, sys, time
from cegppo_trl.tiny_model import warm_tiny
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
_, _, info = warm_tiny(seed=0, sft_steps=2, cache_dir=sys.argv[1])
print(json.dumps({"cached": info["cached"], "key": info["key"]}))
"""


@pytest.mark.slow  # two processes each import torch and TRL and warm-start a model
def test_machines_sharing_output_dir_build_tiny_init_once(tmp_path):
    """The first machine builds `tiny-init` under a lock; the other waits and loads that build (without the lock both
    build at once, and one can read files the other is rewriting). The build appears by a rename: no half-written
    folder is ever at the final path, and no staging folder is left."""
    import subprocess
    import sys

    from launching import subprocess_env

    path, go = tmp_path / "run" / "tiny-init", tmp_path / "go"
    cmd = [sys.executable, "-c", _MACHINE, str(path), str(go)]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    machines = [subprocess.Popen(cmd, env=subprocess_env(), **pipes) for _ in range(2)]
    go.touch()
    results = []
    for machine in machines:
        out, err = machine.communicate(timeout=600)
        assert machine.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["cached"] for r in results) == [False, True], results
    assert results[0]["key"] == results[1]["key"]
    assert json.loads((path / "tiny_build.json").read_text())["key"] == results[0]["key"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-init", "tiny-init.lock"]
