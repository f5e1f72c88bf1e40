"""Where two train steps' time goes: kernel time per op type, side by side.

    python benchmarks/op_profile.py [--model NAME] [--sides a,b] [--steps N] [--rounds R]

A ratio of step times says that one step is slower, not why. This runs
two sides of `bench_targets.py` (`--sides`, keys of its `SIDES`: default
`acc_unsafe,keras_acc`) on one of its models (`--model`, default
`mlp_256x1024_b64`), each step function built as the target table builds
it (`sides.step_fn`), and profiles `--steps` steps of each under
TensorFlow's profiler (`tf.profiler.experimental`), the two sides
alternating for `--rounds` rounds. From each trace (an XSpace protobuf)
it adds up the kernel time of every TensorFlow op event by op type, per
step, and prints per type the median over rounds of each side, their
difference and the number of ops of that type run per step: the types
whose time differs are where the step-time ratio comes from. The sum of
kernel times counts both of the machine's compute threads (it can exceed
the step's wall time) and leaves out the executor's scheduling between
kernels (`wall - kernels` in the last lines hints at it). Kernel times
on a loaded machine stretch both sides alike: the difference per type is
steadier than the step-time ratio, but quote it with its spread.

Not part of `run_all.py` (not a `bench_*` script): a diagnosis tool.
"""

import collections
import glob
import os
import shutil
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402


def kernel_times(xspace_path):
    """`{op type: (picoseconds, events)}` of the TensorFlow op events of a
    trace: events named `<op name>:<op type>` on the host's executor lines
    (`tf_Compute/...`; the Python line's calls and the runtime's own
    events are left out)."""
    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    times, counts = collections.Counter(), collections.Counter()
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = names[event.metadata_id].name
                if ":" not in name or "::" in name:  # the executor's own events
                    continue
                kind = name.rsplit(":", 1)[-1]
                times[kind] += event.duration_ps
                counts[kind] += 1
    return {k: (times[k], counts[k]) for k in times}


def profiled(run, steps):
    """`(kernel times per type per step in microseconds, ops per step,
    wall seconds per step)` of one call of `run` (a `step_fn`)."""
    directory = tempfile.mkdtemp(prefix="op_profile_")
    try:
        tf.profiler.experimental.start(directory)
        seconds = run()
        tf.profiler.experimental.stop()
        (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        found = kernel_times(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    per_step = {k: ps / 1e6 / steps for k, (ps, _) in found.items()}
    ops = {k: n / steps for k, (_, n) in found.items()}
    return per_step, ops, statistics.median(seconds)


def main(argv=None):
    import bench_targets

    parser = bench_targets.two_side_parser(__doc__, "mlp_256x1024_b64", "acc_unsafe,keras_acc")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=20, help="op types shown")
    args = parser.parse_args(argv)
    sides = bench_targets.parsed_sides(parser, args)
    data = bench_targets.model_data(args.model)

    runs = {
        s: bench_targets.timed_side(s, args.model, bench_targets.GraphMode, args.steps, data)
        for s in sides
    }
    measured = {s: [] for s in sides}
    for r in range(args.rounds):
        for s in sides if r % 2 == 0 else sides[::-1]:
            measured[s].append(profiled(runs[s], args.steps))
    kinds = set().union(*(m[0] for rounds in measured.values() for m in rounds))

    def median(side, kind, field=0):
        return statistics.median(m[field].get(kind, 0.0) for m in measured[side])

    rows = sorted(kinds, key=lambda k: -abs(median(sides[0], k) - median(sides[1], k)))[: args.top]
    a, b = sides
    print(
        f"\nKernel time per step by op type (us, median of {args.rounds} rounds of "
        f"{args.steps} steps): {a} vs {b} on {args.model}"
    )
    print(
        f"{'op type':34s} {a:>12s} {b:>12s} {'difference':>11s} {'ops ' + a:>10s} {'ops ' + b:>10s}"
    )
    for k in rows:
        x, y = median(a, k), median(b, k)
        print(
            f"{k:34s} {x:12.1f} {y:12.1f} {x - y:+11.1f} {median(a, k, 1):10.1f} {median(b, k, 1):10.1f}"
        )
    for s in sides:
        kernels = statistics.median(sum(m[0].values()) for m in measured[s])
        wall = statistics.median(m[2] for m in measured[s]) * 1e6
        spread = [sum(m[0].values()) for m in measured[s]]
        print(
            f"{s}: kernels {kernels:.0f} us/step (rounds {min(spread):.0f}-{max(spread):.0f}), "
            f"wall {wall:.0f} us/step, wall - kernels/2 {wall - kernels / 2:+.0f} us"
        )


if __name__ == "__main__":
    main()
