"""The nodes each train step executes, side by side: the graph TensorFlow runs, not the one traced.

    python benchmarks/executed_nodes.py [--model NAME] [--sides a,b] [--list REGION]

`bench_graph.py` counts the traced step's ops: a `tf.cond` there is one
`If` op and its branch functions. TensorFlow runs something else: grappler
rewrites the graph, and (no XLA) each `If` is lowered to `Switch`/`Merge`
control flow, one `Switch` per tensor or variable the `cond` captures (its
pivots, and `Identity` nodes carrying inputs into a branch), one `Merge` per
output. The branch not taken still goes through the executor as dead nodes
(no kernel runs, the executor still visits each). This builds two sides of
`bench_targets.py` (`--sides`, keys of its `SIDES`: default
`clip,keras_clip_gated`) on one of its models (`--model`, default
`mlp_64x256_b64`) as the target table builds them (`timed_side`), runs one
step of each with TensorFlow's run metadata on, and reads the step's
partition graph (the graph the executor ran, after grappler and lowering:
the largest of the call's function graphs). Prints the node count per op
type, both sides and their difference, then per region: `main` (outside
every `cond`), and per `cond` its `glue` (`Switch`, `Merge`, pivots),
`then` and `else` (on a kept step of a gated update, `else` is the branch
not taken: its nodes run dead). `--list REGION` (e.g. `cond_1/then`) prints
that region's nodes of the first side, by name. `main()` returns
`{side: Counter(op type)}`.

A node is not a time: a `Switch` or a dead node costs the executor a
fraction of a microsecond (no kernel), a `MatMul` far more. Read with
`op_profile.py` (kernel time per op type) and `step_phases.py` (when
each phase of the step ends: a longer critical path). Not part of `run_all.py` (not a
`bench_*` script): a diagnosis tool.
"""

import collections
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tensorflow.python.eager import context  # noqa: E402  (run metadata: no public form)


def executed_graph(side, model, data):
    """The partition graph (a `GraphDef`) of one step of `side` on `model`:
    the largest graph its build and first steps ran (TensorFlow records a
    function's partition graphs when it instantiates it)."""
    import bench_targets

    context.enable_run_metadata()
    try:
        run = bench_targets.timed_side(side, model, bench_targets.GraphMode, 4, data)
        run(1)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    graphs = [g for f in metadata.function_graphs for g in f.partition_graphs]
    return max(graphs, key=lambda g: len(g.node))


def region(node):
    """Where `node` is: `main`, or `<cond>/glue`, `<cond>/then`,
    `<cond>/else` (the lowered `cond`'s name as traced)."""
    found = re.search(r"(cond(?:_\d+)?)/(then|else)/", node.name)
    if found:
        return f"{found.group(1)}/{found.group(2)}"
    found = re.search(r"/(cond(?:_\d+)?)/", node.name)
    return f"{found.group(1)}/glue" if found else "main"


def by_region(graph):
    """`{region: Counter(op type)}` of `graph`'s nodes."""
    regions = collections.defaultdict(collections.Counter)
    for node in graph.node:
        regions[region(node)][node.op] += 1
    return regions


def main(argv=None):
    import bench_targets

    parser = bench_targets.two_side_parser(__doc__, "mlp_64x256_b64", "clip,keras_clip_gated")
    parser.add_argument("--list", default=None, help="a region of the first side to list")
    args = parser.parse_args(argv)
    a, b = bench_targets.parsed_sides(parser, args)
    data = bench_targets.model_data(args.model)
    graphs = {s: executed_graph(s, args.model, data) for s in (a, b)}
    counts = {s: collections.Counter(n.op for n in g.node) for s, g in graphs.items()}
    print(f"\nExecuted nodes per step by op type: {a} vs {b} on {args.model}")
    print(f"{'op type':36s} {a:>18s} {b:>18s} {'difference':>10s}")
    kinds = sorted(
        set(counts[a]) | set(counts[b]), key=lambda k: (-abs(counts[a][k] - counts[b][k]), k)
    )
    for k in kinds:
        x, y = counts[a][k], counts[b][k]
        print(f"{k:36s} {x:18d} {y:18d} {x - y:+10d}")
    x, y = len(graphs[a].node), len(graphs[b].node)
    print(f"{'total':36s} {x:18d} {y:18d} {x - y:+10d}")
    for s in (a, b):
        print(f"\n{s} by region (nodes: op types)")
        for name, kinds in sorted(by_region(graphs[s]).items()):
            listed = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
            print(f"  {name:14s} {sum(kinds.values()):4d}  {listed}")
    if args.list:
        print(f"\n{a}: {args.list}")
        for node in graphs[a].node:
            if region(node) == args.list:
                print(f"  {node.op:24s} {node.name}  <- {list(node.input)}")
    return counts


if __name__ == "__main__":
    main()
