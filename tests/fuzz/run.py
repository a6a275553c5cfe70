"""Run a fuzzer over many seeds and collect failures by class (for long background runs).

    python -m tests.fuzz.run selection dynamo --count 3000 --out /tmp/sel.jsonl
    python -m tests.fuzz.run selection aten --count 1000
    python -m tests.fuzz.run handwritten handwritten --count 500
    python -m tests.fuzz.run handwritten kernels --count 500        # lowering="kernels" (their torch reference on a CPU)
    python -m tests.fuzz.run seed_fold pass --count 3000
    python -m tests.fuzz.run seed_fold pipeline --count 1000   # draftfuse.testing.draft_graphs
    python -m tests.fuzz.run seed_fold fold --count 40

Each example is generate(RandomChooser(seed)): seed N always gives the same program, so a line of
the output file is a reproducer (`python -m tests.fuzz.run selection dynamo --start N --count 1 -v`).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from tests.fuzz.common import Failure, Reject, TapeChooser, shrink


def fuzzer(name):
    import importlib

    module = importlib.import_module(f"tests.fuzz.{'selection' if name == 'handwritten' else name}")
    return _table(module)[name]


def _table(module):
    selection = seed_fold = module
    return {
        "selection": (selection.generate, {"dynamo": selection.check_dynamo, "aten": selection.check_aten, "backend": selection.check_backend, "pipeline": selection.check_pipeline,
                                           "expect": lambda p: selection.check_dynamo(p, expect_rewrites=True),
                                           "kernels": lambda p: selection.check_dynamo(p, lowering="kernels")}, selection.CaptureUnsupported),
        "handwritten": (selection.generate_handwritten, {"handwritten": selection.check_handwritten,
                                                         "kernels": lambda p: selection.check_handwritten(p, lowering="kernels")}, selection.CaptureUnsupported),
    } if hasattr(module, "check_dynamo") else {
        "seed_fold": (seed_fold.generate, {"pass": seed_fold.check_pass, "pipeline": seed_fold.check_pipeline, "fold": seed_fold.check_fold}, seed_fold.CaptureUnsupported),
    }


def _same_failure(oracle, kind, tags, unsupported):
    def fails(program) -> bool:
        if not set(program.tags) <= tags:
            return False
        try:
            oracle(program)
        except Failure as failure:
            return failure.kind == kind
        except unsupported:
            return False
        return False

    return fails


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("fuzzer")
    parser.add_argument("oracle")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--out", default=None)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--shrink", action="store_true", help="shrink each failure (same kind, no new tags)")
    parser.add_argument("--budget", type=int, default=250, help="attempts per shrink")
    args = parser.parse_args(argv)
    generate, oracles, unsupported = fuzzer(args.fuzzer)
    oracle = oracles[args.oracle]
    stats = collections.Counter()
    classes = collections.Counter()
    out = open(args.out, "a") if args.out else None
    started = time.time()
    times = []
    found: list[tuple[str, set]] = []  # (kind, tags of a shrunk program): a superset is not shrunk again
    for seed in range(args.start, args.start + args.count):
        chooser = TapeChooser(seed)
        try:
            program = generate(chooser)
        except Reject:
            stats["rejected"] += 1
            continue
        t0 = time.time()
        record = {"seed": seed, "tags": list(program.tags)}
        try:
            oracle(program)
            stats["passed"] += 1
        except unsupported as error:
            stats["capture unsupported"] += 1
            record.update(status="unsupported", detail=str(error))
        except Failure as failure:
            stats["failed"] += 1
            classes[failure.kind] += 1
            record.update(status="failed", kind=failure.kind, detail=failure.detail[:500], report=failure.report[:1500], source=program.source)
            known = any(k == failure.kind and small <= set(program.tags) for k, small in found)
            if args.shrink and not known:
                small, _ = shrink(generate, _same_failure(oracle, failure.kind, set(program.tags), unsupported), chooser.tape, budget=args.budget)
                found.append((failure.kind, set(small.tags)))
                record.update(small_source=small.source, small_tags=list(small.tags), small_args=[(n, list(t.shape), str(t.dtype)) for n, t in small.args])
                try:
                    oracle(small)
                except Failure as again:
                    record.update(small_detail=again.detail[:300], small_report=again.report[:1000])
        except Exception as error:  # a harness error: say so, keep going
            stats["harness error"] += 1
            record.update(status="harness error", detail=repr(error)[:500], source=program.source)
        times.append(time.time() - t0)
        if args.verbose or record.get("status") == "failed":
            print(json.dumps(record) if not args.verbose else "\n".join(f"{k}: {v}" for k, v in record.items()), flush=True)
        if out and "status" in record:
            out.write(json.dumps(record) + "\n")
            out.flush()
    times.sort()
    median = times[len(times) // 2] if times else 0
    print(f"{args.fuzzer}/{args.oracle}: {dict(stats)} in {time.time() - started:.0f}s, median {median * 1000:.0f} ms/example", file=sys.stderr)
    print(f"failure classes: {dict(classes)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
