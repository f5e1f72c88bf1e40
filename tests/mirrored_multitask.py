"""A multi-task model on one device and on two replicas (two logical CPUs,
`MirroredStrategy`), accumulation 1 and 2: cases of distributed_cases.py
(the process that sets the devices up), asserted by
end_to_end/test_distributed.py.

`results(MODULE, METHOD)`: `MODULE` (a test module's name, found in any
folder of tests/) provides `build`, `compiled`, `make_data`, `weights_of`
and optionally `mirrored_probe(model, x, y) -> dict` (facts about the
untrained model, added to the result).
"""

import contextlib
import glob
import importlib
import os

import numpy as np


def results(strategy, module_name, method):
    """`{"acc1": {...}, "acc2": {...}}`: each accumulation setting's result,
    under `strategy` (a MirroredStrategy over two devices)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    # the test module, in its folder of tests/ (imported as part of the package)
    (path,) = glob.glob(os.path.join(tests, "**", f"{module_name}.py"), recursive=True)
    relative = os.path.relpath(path, os.path.dirname(tests))[: -len(".py")]
    module = importlib.import_module(relative.replace(os.sep, "."))
    probe = getattr(module, "mirrored_probe", None)

    x, y = module.make_data(n=11)  # global batches 4, 4, 3: the last splits 2 / 1
    result = {}
    for acc in (1, 2):
        runs, facts = [], {}
        for distributed in (False, True):
            with strategy.scope() if distributed else contextlib.nullcontext():
                model = module.compiled(
                    module.build(multitask=method, accumulation_steps=acc, telemetry=True)
                )
            if probe is not None:
                facts = probe(model, x, y)
            history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
            weights = module.weights_of(model)
            runs.append((list(weights.values()) if isinstance(weights, dict) else weights, history))
        result[f"acc{acc}"] = {
            **facts,
            "max_weight_diff": max(
                float(np.max(np.abs(a - b))) for a, b in zip(runs[0][0], runs[1][0])
            ),
            "norm_a": [runs[0][1]["task_grad_norm/a"][-1], runs[1][1]["task_grad_norm/a"][-1]],
        }
    return result
