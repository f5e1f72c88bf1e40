"""How much two instances of one configuration differ: the floor under a
target's margin.

    python benchmarks/instance_spread.py [--model NAME] [--sides a,b]
                                         [--instances N] [--rounds R]

A target row times one instance of each side (`bench_targets.py`). On this
machine two instances of the same configuration, built one after the
other in one process, do not run equally fast (where their memory lies,
which thread runs which kernel): the A/A rows show it for `keras.Model`.
This builds `--instances` instances of each of two sides of
`bench_targets.py` (`--sides`, keys of its `SIDES`: default
`default,keras_gated`) on one of its models (`--model`, default
`mlp_64x256_b64`), in the order a0 b0 a1 b1 ..., and times, interleaved
as the target table does (`harness.interleaved_step_ratios`, `--rounds`
rounds):

- every cross pair `a_i / b_j` (what a target row would read with those
  two instances);
- each side's consecutive instances `a_i / a_i+1`, `b_i / b_i+1` (A/A
  pairs of the side's own configuration).

It prints each pair's median ratio and the range of the cross pairs and of
the A/A pairs. When the A/A pairs stray from 1.000 by as much as a target's
margin, one process cannot judge that target: its verdict depends on which
instances it built.

Not part of `run_all.py` (not a `bench_*` script): a diagnosis tool.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None):
    import bench_targets
    from harness import interleaved_step_ratios

    parser = bench_targets.two_side_parser(__doc__, "mlp_64x256_b64", "default,keras_gated")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    sides = bench_targets.parsed_sides(parser, args)
    if args.instances < 2:
        raise ValueError(
            f"`--instances` must be at least 2 (an A/A pair needs two). "
            f"Received: {args.instances}. Fix: e.g. `--instances 3`."
        )
    steps = bench_targets.steps_on(args.model)  # a round of the target table
    data = bench_targets.model_data(args.model)

    a, b = sides
    runs = {}
    for i in range(args.instances):
        for side in sides:
            runs[f"{side}{i}"] = bench_targets.timed_side(
                side, args.model, bench_targets.GraphMode, steps, data
            )
    n = range(args.instances)
    cross = [(f"{a}{i} / {b}{j}", runs[f"{a}{i}"], runs[f"{b}{j}"]) for i in n for j in n]
    same = [
        (f"{s}{i} / {s}{i + 1}", runs[f"{s}{i}"], runs[f"{s}{i + 1}"])
        for s in sides
        for i in range(args.instances - 1)
    ]
    results = interleaved_step_ratios(cross + same, args.rounds)
    print(
        f"\n{args.model}, {args.instances} instances of {a} and {b} (built {a}0 {b}0 {a}1 ...), "
        f"{args.rounds} rounds of {steps} steps; the ratio of median steps:"
    )
    for name, stats in results.items():
        print(f"  {name:40s} {stats['median']:.3f}  (rounds {stats['min']:.3f}-{stats['max']:.3f})")
    for label, pairs in (("cross pairs", cross), ("A/A pairs", same)):
        medians = [results[name]["median"] for name, _, _ in pairs]
        print(f"{label}: {min(medians):.3f}-{max(medians):.3f}")
    return results


if __name__ == "__main__":
    main()
