"""The XLA-vs-torch single-operation benchmark: both sides compute the same thing, and the report renders."""

from lab.bench import op_compare


def test_every_case_computes_the_same_on_both_sides_and_times_both():
    rows = [op_compare.measure(c, repeats=2, reps=2, seed=3) for c in op_compare.cases()]
    assert len(rows) == 5
    for r in rows:
        assert r["rel_diff"] < 1e-5, r["case"]
        assert len(r["ms"]["xla"]) == len(r["ms"]["torch"]) == len(r["ratio"]) == 2
        assert all(v > 0 for v in r["ms"]["xla"] + r["ms"]["torch"])
    md = op_compare.markdown({"label": "t", "model": "dsv3-15m", "repeats": 2, "reps": 2, "torch_threads": 2,
                              "torch_version": "x", "environment": {}, "rows": rows})
    assert md.count("\n| ") == 1 + len(rows) and "decode MLA attention, 32 rows x 160 tokens" in md


def test_a_side_computing_something_else_shows_in_the_difference():
    case = op_compare.cases()[2]  # expert FFN
    wrong = op_compare.Case(case.name, case.shapes, case.xla, lambda x, wg, wu, wd: (x @ wg) * (x @ wu) @ wd)
    assert op_compare.measure(wrong, repeats=1, reps=1)["rel_diff"] > 1e-2
