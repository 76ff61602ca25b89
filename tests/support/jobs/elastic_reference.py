"""Runs DeepSpeed 0.19.7's own `compute_elastic_config` (the last release that has it) over cases
read as JSON from stdin, and writes its answers as JSON to stdout. Started by the tests in a
subprocess whose sys.path starts with the isolated 0.19.7 install (scripts/bootstrap.sh puts it in
.venv/ref/deepspeed-0.19.7), so that it never mixes with the DeepSpeed the suite trains with.

    input:  [{"block": {...elasticity...}, "world_sizes": [0, 2, 3]}, ...]
    output: [[{"batch": B, "valid": [...], "micro": M} | {"error": "ClassName"}, ...], ...]
"""

from __future__ import annotations

import json
import logging
import sys


def main() -> int:
    answer_to = sys.stdout
    sys.stdout = sys.stderr  # DeepSpeed logs to stdout: keep it out of the answer
    import deepspeed
    from deepspeed.elasticity import compute_elastic_config

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    cases = json.load(sys.stdin)
    out = []
    for case in cases:
        answers = []
        for ws in case["world_sizes"]:
            try:
                got = compute_elastic_config(
                    {"elasticity": case["block"]}, deepspeed.__version__, world_size=ws
                )
            except Exception as e:
                answers.append({"error": type(e).__name__})
                continue
            valid = None if got[1] is None else [int(n) for n in got[1]]
            answer = {"batch": int(got[0]), "valid": valid}
            if len(got) > 2:
                answer["micro"] = int(got[2])
            answers.append(answer)
        out.append(answers)
    json.dump({"version": deepspeed.__version__, "answers": out}, answer_to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
