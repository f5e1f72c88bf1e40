"""tools/graph_fingerprints.py: the traced step's fingerprint per
configuration, and the comparison that says which changed."""

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _tool():
    path = REPO / "tools" / "graph_fingerprints.py"
    spec = importlib.util.spec_from_file_location("graph_fingerprints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_differences_name_the_op_types_that_changed():
    tool = _tool()
    before = {
        "a": {"ops": 3, "by_type": {"Add": 2, "Mul": 1}},
        "b": {"ops": 1, "by_type": {"Add": 1}},
        "c": {"ops": 5, "sha1": "x"},
        "only_before": {"ops": 1, "by_type": {"Add": 1}},
    }
    after = {
        "a": {"ops": 3, "by_type": {"Add": 1, "Mul": 1, "Sub": 1}},
        "b": {"ops": 1, "by_type": {"Add": 1}},
        "c": {"ops": 5, "sha1": "y"},
    }
    assert tool.differences(before, after) == {
        "a": "3 -> 3 ops: {'Add': -1, 'Sub': 1}",
        "c": "5 -> 5 ops, the text differs",
    }


def test_a_run_matches_itself_and_finds_a_changed_fingerprint(tmp_path):
    tool = _tool()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert tool.main([str(first), "--only", "default"]) == 0
    assert tool.main([str(second), "--only", "default", "--compare", str(first)]) == 0
    changed = json.loads(first.read_text())
    fingerprint = changed["default"]
    fingerprint["ops"] += 1
    if "by_type" in fingerprint:
        fingerprint["by_type"]["Extra"] = 1
    else:
        fingerprint["sha1"] = "0" * 40
    first.write_text(json.dumps(changed))
    assert tool.main([str(second), "--only", "default", "--compare", str(first)]) == 1
