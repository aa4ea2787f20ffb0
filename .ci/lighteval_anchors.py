"""Regenerate the anchor verdicts of tests/data/protocol_cases.jsonl from the anchors themselves.

    python3 .ci/lighteval_anchors.py            # builds the side venvs under build/anchors/ when missing

For every case (a completion and a gold answer) it records:

- ``authors``: the CE-GPPO authors' reward (+1 / -1), their procedure (Kwai-Klear/CE-GPPO at 10558fe,
  ``math_dapo.py``, ``math_verify_from_sky``) run step by step with math-verify itself, once per math-verify
  version: 0.7.0 (the authors' pin) and 0.8.0 / 0.9.0 (this package's range), each in its own venv;
- ``lighteval``: lighteval 0.13.0's own metric objects on the completion as its pipeline hands them over
  (``--remove-reasoning-tags`` on, ``<think>``/``</think>``): ``pass_at_k`` (``Metrics.pass_at_k_math``, k=n=1:
  math_500, aime24/25's pass@1) and ``avg_at_n`` (``Metrics.avg_at_n_math``, n=1: aime24_avg / aime25_avg);
- ``boxed``: this package's reward status (``grade_completions``), per math-verify version.

and checks that ``LIGHTEVAL_MATH_TEMPLATE`` equals lighteval's AIME prompt template. It then prints the agreement
of this package's protocols with the anchors. tests/test_protocols.py checks the protocols against these verdicts
in the fast tier without any of the side venvs. Needs the package registry (pip) the first time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "data" / "protocol_cases.jsonl"
META = ROOT / "tests" / "data" / "protocol_anchors.json"
VENVS = ROOT / "build" / "anchors"
MATH_VERIFY_VERSIONS = ("0.7.0", "0.8.0", "0.9.0")
OURS = ("0.8.0", "0.9.0")  # versions inside this package's range, where its own protocols are graded too
LIGHTEVAL = "0.13.0"

# The authors' math_verify_from_sky, step by step (their code is read, not copied): parse the whole completion
# with the defaults and parsing_timeout=5; fewer than 2 results -> -1; parsed[1] in [gold] -> +1; else verify
# against parse("\\boxed{gold}") with timeout_seconds=5 -> +1, anything else (exceptions included) -> -1.
AUTHORS_PROGRAM = r"""
import json, logging, sys
logging.disable(logging.CRITICAL)
from math_verify import parse, verify

def reward(completion, gold):
    try:
        parsed = parse(completion, parsing_timeout=5)
    except Exception:
        return -1
    if len(parsed) < 2:
        return -1
    if parsed[1] in [gold]:
        return 1
    try:
        if verify(parse("\\boxed{" + gold + "}", parsing_timeout=5), parsed, timeout_seconds=5):
            return 1
    except Exception:
        pass
    return -1

cases = json.load(sys.stdin)
json.dump([reward(c["completion"], c["gold"]) for c in cases], sys.stdout)
"""

LIGHTEVAL_PROGRAM = r"""
import json, logging, sys
logging.disable(logging.CRITICAL)
from lighteval.metrics.metrics import Metrics
from lighteval.models.model_output import ModelResponse
from lighteval.tasks.requests import Doc
from lighteval.tasks.tasks.aime import MATH_PROMPT_TEMPLATE
from lighteval.utils.utils import remove_reasoning_tags

TAGS = [("<think>", "</think>")]  # lighteval's PipelineParameters.reasoning_tags default
pass_at_k = Metrics.pass_at_k_math(sample_params={"k": 1, "n": 1}).sample_level_fn
avg_at_n = Metrics.avg_at_n_math(sample_params={"n": 1}).sample_level_fn
out = {"template": MATH_PROMPT_TEMPLATE.format(prompt="{problem}"), "verdicts": []}
for case in json.load(sys.stdin):
    doc = Doc(query="problem", choices=[case["gold"]], gold_index=0)  # aime_prompt: choices=[line["answer"]]
    text = case["completion"]

    def response():  # as Pipeline._post_process_outputs leaves it
        return ModelResponse(text=[text], text_post_processed=[remove_reasoning_tags(text, TAGS)])

    out["verdicts"].append({
        "pass_at_k": float(pass_at_k.compute(doc=doc, model_response=response())),
        "avg_at_n": float(avg_at_n.compute(doc=doc, model_response=response())),
    })
json.dump(out, sys.stdout)
"""

# This package's protocols under one math-verify version (the repository on PYTHONPATH, the venv's math-verify).
OURS_PROGRAM = r"""
import json, sys
from cegppo_trl.rewards import grade_completions
from cegppo_trl.rewards.protocols import authors, lighteval, lighteval_avg
cases = json.load(sys.stdin)
boxed = grade_completions([c["completion"] for c in cases], [c["gold"] for c in cases], timeout_s=30)
json.dump([
    {"authors": authors(c["completion"], c["gold"]), "lighteval": lighteval(c["completion"], c["gold"]),
     "lighteval_avg": lighteval_avg(c["completion"], c["gold"]), "boxed": b.status}
    for c, b in zip(cases, boxed)
], sys.stdout)
"""


def venv_python(name: str, requirements: list[str]) -> Path:
    """The python of ``build/anchors/<name>``, created with ``requirements`` when missing."""
    python = VENVS / name / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(VENVS / name)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True)
    return python


def run(python: Path, program: str, cases: list[dict], env: dict | None = None):
    done = subprocess.run(
        [str(python), "-c", program], input=json.dumps(cases), capture_output=True, text=True, env=env, check=False
    )
    if done.returncode:
        raise SystemExit(f"{python} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()  # no options: --help says what it does before it builds anything
    cases = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    inputs = [{"completion": c["completion"], "gold": c["gold"]} for c in cases]
    authors = {
        v: run(venv_python(f"mv{v}", [f"math-verify=={v}"]), AUTHORS_PROGRAM, inputs) for v in MATH_VERIFY_VERSIONS
    }
    # lighteval pins latex2sympy2_extended 1.0.6 and imports torch: the CPU torch keeps the venv small.
    lighteval_python = venv_python(f"lighteval{LIGHTEVAL}", ["torch==2.13.0", f"lighteval=={LIGHTEVAL}"])
    lighteval = run(lighteval_python, LIGHTEVAL_PROGRAM, inputs)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ours = {v: run(VENVS / f"mv{v}" / "bin" / "python", OURS_PROGRAM, inputs, env) for v in OURS}

    sys.path.insert(0, str(ROOT))
    from cegppo_trl.rewards.protocols import LIGHTEVAL_MATH_TEMPLATE

    if lighteval["template"] != LIGHTEVAL_MATH_TEMPLATE:
        raise SystemExit(f"LIGHTEVAL_MATH_TEMPLATE differs from lighteval's:\n{lighteval['template']!r}")
    for i, case in enumerate(cases):
        case["authors"] = {minor(v): authors[v][i] for v in MATH_VERIFY_VERSIONS}
        case["lighteval"] = lighteval["verdicts"][i]
        case["boxed"] = {minor(v): ours[v][i]["boxed"] for v in OURS}
    CASES.write_text("".join(json.dumps(c) + "\n" for c in cases))
    META.write_text(
        json.dumps(
            {
                "math_verify_versions": list(MATH_VERIFY_VERSIONS),
                "lighteval": LIGHTEVAL,
                "lighteval_math_template": lighteval["template"],
                "cases": len(cases),
                "generated_by": "python3 .ci/lighteval_anchors.py",
            },
            indent=1,
        )
        + "\n"
    )
    report(cases, ours)


def report(cases: list[dict], ours: dict) -> None:
    """Agreement of each protocol with each anchor, per math-verify version; the disagreeing case ids."""
    n = len(cases)
    for v in OURS:
        m = minor(v)

        def differ(protocol: str, anchor) -> list[str]:
            return [c["id"] for c, o in zip(cases, ours[v]) if (o[protocol] == "correct") != anchor(c)]

        lines = {
            "authors vs the authors' procedure": differ("authors", lambda c: c["authors"][m] == 1),
            "lighteval vs lighteval pass@k": differ("lighteval", lambda c: c["lighteval"]["pass_at_k"] == 1),
            "lighteval_avg vs lighteval avg@n": differ("lighteval_avg", lambda c: c["lighteval"]["avg_at_n"] == 1),
            "boxed vs the authors' procedure": differ("boxed", lambda c: c["authors"][m] == 1),
            "boxed vs lighteval pass@k": differ("boxed", lambda c: c["lighteval"]["pass_at_k"] == 1),
            "the authors' procedure at 0.7.0": [c["id"] for c in cases if c["authors"]["0.7"] != c["authors"][m]],
        }
        print(f"math-verify {v}, {n} cases:")
        for name, ids in lines.items():
            print(f"  {name}: {n - len(ids)}/{n} agree; differ: {', '.join(ids) or '-'}")
    moved = [c["id"] for c in cases if c["authors"]["0.8"] != c["authors"]["0.9"]]
    print(f"the authors' procedure, 0.8 vs 0.9: {len(moved)} differ: {', '.join(moved) or '-'}")
    split = [c["id"] for c in cases if c["lighteval"]["pass_at_k"] != c["lighteval"]["avg_at_n"]]
    print(f"lighteval pass@k vs avg@n: {len(split)} differ: {', '.join(split) or '-'}")


if __name__ == "__main__":
    main()
