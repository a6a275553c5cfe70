"""Shrink the failures a `run.py --out` file recorded, fewest hazards first, skipping a failure whose
tags contain those of an already shrunk one of the same kind (most likely the same cause).

    python -m tests.fuzz.shrink_failures seed_fold pass /tmp/sf.jsonl --limit 15 > /tmp/sf_small.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

from tests.fuzz.common import Failure, TapeChooser, shrink
from tests.fuzz.run import _same_failure, fuzzer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("fuzzer")
    parser.add_argument("oracle")
    parser.add_argument("records")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--budget", type=int, default=250)
    parser.add_argument("--only", default=None, help="only records whose tags include this substring")
    args = parser.parse_args(argv)
    generate, oracles, unsupported = fuzzer(args.fuzzer)
    oracle = oracles[args.oracle]
    records = [json.loads(line) for line in open(args.records)]
    failed = [r for r in records if r.get("status") == "failed" and (args.only is None or any(args.only in t for t in r["tags"]))]
    failed.sort(key=lambda r: len(r["tags"]))
    found: list[tuple[str, set]] = []
    done = 0
    for record in failed:
        if done >= args.limit:
            break
        if any(kind == record["kind"] and small <= set(record["tags"]) for kind, small in found):
            continue
        chooser = TapeChooser(record["seed"])
        program = generate(chooser)
        small, _ = shrink(generate, _same_failure(oracle, record["kind"], set(program.tags), unsupported), chooser.tape, budget=args.budget)
        found.append((record["kind"], set(small.tags)))
        out = {"seed": record["seed"], "kind": record["kind"], "tags": list(small.tags), "source": small.source}
        try:
            oracle(small)
        except Failure as failure:
            out.update(detail=failure.detail[:400], report=failure.report[:2000])
        except Exception as error:  # noqa: BLE001
            out.update(detail=repr(error)[:400])
        out["reproducer"] = small.reproducer(args.oracle)
        print(json.dumps(out), flush=True)
        done += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
