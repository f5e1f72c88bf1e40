"""When each phase of a train step ends, side by side: where a step's critical path is longer.

    python benchmarks/step_phases.py [--model NAME] [--sides a,b] [--steps N] [--rounds R]

`op_profile.py` adds up kernel time per op type; a step can be slower with
less kernel time, when its ops wait on each other more (2 cores, mostly
idle on a small model). This profiles `--steps` steps of two sides of
`bench_targets.py` (`--sides`, keys of its `SIDES`: default
`clip,keras_clip_gated`, built as `timed_side` builds them) under
TensorFlow's profiler, the sides alternating for `--rounds` rounds, and
per step measures from the start of the step's call (the Python thread's
`EagerKernelExecute` of the train function) to: the first op, the loss
op's end, the end of backprop (the last `MatMul`, `BiasAddGrad` or
`ReluGrad`), the first op in a `cond` branch (`/then/` in its name: the
update's), the end of the last op in one, the last op's end and the call's
end; and counts the ops that start after the last branch op ends (the
step's tail: work that waited for the whole update). Prints the median
over every step of every round, and the tail's ops of one step per side.

The profiler adds about a microsecond per op and the machine's load
stretches every phase: compare the two sides' phases within one run. Not
part of `run_all.py` (not a `bench_*` script): a diagnosis tool.
"""

import bisect
import collections
import glob
import os
import shutil
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

BACKPROP = {"_MklMatMul", "_MklNativeFusedMatMul", "MatMul", "BiasAddGrad", "ReluGrad"}


def events(run):
    """`(calls, ops)` of one call of `run` (a `step_fn`) under the
    profiler: the train function's calls as `(start, end)` and the op
    events as `(start, end, name, type)`, in picoseconds, sorted."""
    directory = tempfile.mkdtemp(prefix="step_phases_")
    try:
        tf.profiler.experimental.start(directory)
        run()
        tf.profiler.experimental.stop()
        (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    calls, ops = [], []
    for plane in space.planes:
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                start = base + event.offset_ps
                span = (start, start + event.duration_ps)
                if line.name == "python" and name == "EagerKernelExecute":
                    calls.append(span)
                elif line.name.startswith("tf_Compute") and ":" in name and "::" not in name:
                    ops.append((*span, *name.rsplit(":", 1)))
    # The train function's calls: the long ones (the iterator's are short).
    longest = max(b - a for a, b in calls)
    return sorted(c for c in calls if c[1] - c[0] > longest / 4), sorted(ops)


def phases(calls, ops):
    """`({phase: [microseconds per step]}, [tail op types of one step])`."""
    found, starts, tail = collections.defaultdict(list), [o[0] for o in ops], []
    for a, b in calls:
        inside = ops[bisect.bisect_left(starts, a) : bisect.bisect_right(starts, b)]
        branch = [o for o in inside if "/then/" in o[2]]
        backprop = [o[1] for o in inside if o[3] in BACKPROP]
        if not branch or not backprop:
            continue
        loss = [o[1] for o in inside if o[3] == "SparseSoftmaxCrossEntropyWithLogits"]
        branch_end = max(o[1] for o in branch)
        after = [o for o in inside if o[0] >= branch_end]
        marks = {
            "first op": inside[0][0],
            "loss op end": loss[0] if loss else None,
            "backprop end": max(backprop),
            "first op in a cond branch": min(o[0] for o in branch),
            "last op in a cond branch, end": branch_end,
            "last op end": max(o[1] for o in inside),
            "call end": b,
        }
        for phase, t in marks.items():
            if t is not None:
                found[phase].append((t - a) / 1e6)
        found["ops after the last branch op (tail)"].append(len(after))
        tail = [o[3] for o in after]
    return found, tail


def main(argv=None):
    import bench_targets

    parser = bench_targets.two_side_parser(__doc__, "mlp_64x256_b64", "clip,keras_clip_gated")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    sides = bench_targets.parsed_sides(parser, args)
    data = bench_targets.model_data(args.model)
    runs = {
        s: bench_targets.timed_side(s, args.model, bench_targets.GraphMode, args.steps, data)
        for s in sides
    }
    measured = {s: collections.defaultdict(list) for s in sides}
    tails = {}
    for r in range(args.rounds):
        for s in sides if r % 2 == 0 else sides[::-1]:
            found, tails[s] = phases(*events(runs[s]))
            for phase, values in found.items():
                measured[s][phase].extend(values)
    a, b = sides
    print(f"\nMicroseconds from the step's call (median over steps): {a} vs {b} on {args.model}")
    print(f"{'phase':40s} {a:>18s} {b:>18s} {'difference':>11s}")
    result = {}
    for phase in measured[a]:
        x, y = (statistics.median(measured[s][phase] or [0.0]) for s in sides)
        result[phase] = (x, y)
        print(f"{phase:40s} {x:18.1f} {y:18.1f} {x - y:+11.1f}")
    for s in sides:
        print(f"{s}: the tail of one step: {tails[s]}")
    return result


if __name__ == "__main__":
    main()
