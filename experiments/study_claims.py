"""The study's claims (docs/comparison.md): which pair of arms tests which of the paper's claims, each judged by the
verdict rule of `cegppo-compare`'s report, from a comparison's ``results.json``.

    python experiments/study_claims.py build/study/tiny/results.json    # the verdict table, Markdown

(i) CE-GPPO's training entropy above GRPO's; (ii) beta2 alone (0, 1) above GRPO, beta1 alone (1, 0) below it; (iii)
CE-GPPO's avg@k higher than GRPO's, with pass@k not lower. The library reports differences and the rule; this file
holds the study's reading of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cegppo_trl.comparison.report import verdict


#: (arm, direction, claim) of the entropy claims: the arm minus GRPO, in the direction the paper claims.
ENTROPY_CLAIMS = (("cegppo", 1, "(i) CE-GPPO's entropy stays above GRPO's over training"),
                  ("b0-1", 1, "(ii) beta2 alone (0, 1): entropy above GRPO's"),
                  ("b1-0", -1, "(ii) beta1 alone (1, 0): entropy below GRPO's"))  # fmt: skip


def _per_seed(versus: dict, arm: str, *path: str) -> list[float]:
    values = []
    for entry in versus[arm]["per_seed"]:
        for key in path:
            entry = entry[key]
        values.append(entry[0] if isinstance(entry, tuple | list) else entry)
    return values


def claims(summary: dict, protocols: list[str]) -> list[dict]:
    """Each claim whose arms were run against a GRPO reference, with its per-seed differences and verdict."""
    if summary["reference"] != "grpo":
        return []
    versus, found = summary["versus"], []
    for arm, sign, text in ENTROPY_CLAIMS:
        if arm in versus:
            d = _per_seed(versus, arm, "train_entropy")
            found.append({"claim": text, "diffs": d, "verdict": verdict(d, sign)})
    if "cegppo" in versus:
        for p in protocols:
            avg, best = _per_seed(versus, "cegppo", p, "avg"), _per_seed(versus, "cegppo", p, "pass")
            both = (verdict(avg), verdict(best))
            overall = "no" if "no" in both else "yes" if both[0] == "yes" else "inside the noise"
            found.append({"claim": f"(iii) CE-GPPO's avg@k above GRPO's, pass@k not lower ({p} grading)",
                          "diffs": avg, "pass_diffs": best, "verdict": overall})  # fmt: skip
    return found


def claim_rows(found: list[dict]) -> list[str]:
    lines = ["| the paper's claim | per seed (arm - GRPO) | verdict |", "|---|---|---|"]
    for c in found:
        scale, unit = (100.0, " pp") if c["claim"].startswith("(iii)") else (1.0, " nats")
        values = ", ".join(f"{scale * d:+.{1 if scale == 100 else 3}f}" for d in c["diffs"]) + unit
        if "pass_diffs" in c:
            values += "; pass@k " + ", ".join(f"{100 * d:+.1f}" for d in c["pass_diffs"]) + " pp"
        lines.append(f"| {c['claim']} | {values} | **{c['verdict']}** |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", metavar="RESULTS.json", help="a comparison's results.json")
    path = parser.parse_args(argv).results
    if not os.path.isfile(path):
        parser.exit(2, f"study_claims.py: {path}: no such file; run the README's cegppo-compare command first.\n")
    result = json.loads(open(path).read())
    settings = result["settings"]
    protocols = settings.get("protocols") or settings["shaping"]["protocols"]  # the study's results, or the engine's
    print("\n".join(claim_rows(claims(result["summary"], protocols))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
