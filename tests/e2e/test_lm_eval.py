"""The standard-tool experiments' own logic (lab/eval/lm_eval_tasks.py, lab/eval/tasks/, lab/bench/lm_eval_run.py,
lab/bench/guidellm_sweep.py, lab/bench/served.py), without the tools: lm-eval and guidellm are not in the project's
install, so their real runs are the committed results in benchmarks/lm_eval and benchmarks/guidellm. Here: the
shipped task data is what the builder writes, the task files name fields the data has, the tool-call scorer that
runs inside lm-eval agrees with the project's checker, and lm-eval's and guidellm's real output files (recorded from
the tools: lm-eval's ``dummy`` model on these tasks, a guidellm sweep) are read, compared and reported correctly.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from lab.bench import guidellm_sweep as gs
from lab.bench import lm_eval_run as le
from lab.bench.served import ToolError, count_compiles, run_tool
from lab.eval import lm_eval_tasks as lt
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import TOOLS, examples, validate_call

DATA = Path(__file__).parent / "data"
DUMMY = DATA / "lm_eval_dummy"  # lm_eval run --model dummy --tasks ps_code_mc,ps_code_ppl,ps_toolcalls --limit 3


def _utils():
    spec = importlib.util.spec_from_file_location("ps_task_utils", lt.TASKS_DIR / "utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _TaskLoader(yaml.SafeLoader):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: ("!function", loader.construct_scalar(node)))


def _task(name: str) -> dict:
    return yaml.load((lt.TASKS_DIR / f"{name}.yaml").read_text(), Loader=_TaskLoader)


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (lt.DATA_DIR / f"{name}.jsonl").read_text().splitlines()]


def test_shipped_task_data_is_what_the_builder_writes(tmp_path):
    counts = lt.build(tmp_path)
    assert counts == {"ps_toolcalls": lt.NUM_TOOLCALLS, "ps_code_ppl": len(_docs("ps_code_ppl")),
                      "ps_code_mc": lt.NUM_MC}
    for f in sorted(tmp_path.iterdir()):
        assert f.read_bytes() == (lt.DATA_DIR / f.name).read_bytes(), f"{f.name} differs from the builder's output"
    assert json.loads((lt.DATA_DIR / "tools.json").read_text()) == TOOLS


def test_task_files_name_fields_the_data_has():
    for name in lt.TASKS:
        task = _task(name)
        assert task["task"] == name
        assert Path(task["dataset_kwargs"]["data_files"]["test"]) == (lt.DATA_DIR / f"{name}.jsonl").relative_to(
            lt.TASKS_DIR.parents[2])
        docs = _docs(name)
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
            if task.get(key):
                assert all(task[key] in d for d in docs), (name, key)
    assert _task("ps_toolcalls")["process_results"] == ("!function", "utils.process_toolcall")
    assert {m["metric"] for m in _task("ps_toolcalls")["metric_list"]} == {"exact_match", "valid"}


def test_task_documents_are_held_out_and_well_formed():
    tok = ByteTokenizer()
    heldout = {ex.request for ex in examples(lt.NUM_TOOLCALLS, mix="single")}
    longest = 0
    for d in _docs("ps_toolcalls"):
        assert d["prompt"].endswith("\n") and d["prompt"][:-1] in heldout
        assert validate_call(d["call"]) == [] and json.loads(d["target"]) == d["call"]
        longest = max(longest, len([tok.tool_start_id, *tok.encode(d["target"]), tok.tool_end_id, tok.eos_id]))
    assert _task("ps_toolcalls")["generation_kwargs"]["max_gen_toks"] >= longest  # no answer cut short
    for d in _docs("ps_code_ppl"):
        assert 0 < len(tok.encode(d["text"])) <= lt.PPL_BYTES and d["text"].endswith("\n")
    for d in _docs("ps_code_mc"):
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4 and 0 <= d["label"] < 4
        assert d["context"].endswith("\n") and len(d["context"].encode()) <= lt.MC_CONTEXT
        assert all(len(c.strip()) >= lt.MC_MIN_LINE for c in d["choices"])


def _corrupted(call: dict) -> list:
    wrong_name = {**call, "name": "book_hotel"}
    extra_key = {**call, "id": 1}
    missing = {"name": call["name"], "arguments": dict(list(call["arguments"].items())[1:])}
    retyped = copy.deepcopy(call)
    key = next(iter(retyped["arguments"]))
    retyped["arguments"][key] = [retyped["arguments"][key]]
    return [wrong_name, extra_key, missing, retyped, [call], "call"]


def test_toolcall_scorer_agrees_with_the_projects_checker():
    utils = _utils()
    for d in _docs("ps_toolcalls"):
        for call in [d["call"], *_corrupted(d["call"])]:
            assert utils.valid_call(call) == (validate_call(call) == []), call


def test_toolcall_scorer_reads_generations_with_or_without_markers():
    utils = _utils()
    doc = _docs("ps_toolcalls")[0]
    other = _docs("ps_toolcalls")[1]["target"]
    assert utils.process_toolcall(doc, [doc["target"]]) == {"exact_match": 1.0, "valid": 1.0}
    assert utils.process_toolcall(doc, [f"<tool_call>{doc['target']}</tool_call><eos>"]) == \
        {"exact_match": 1.0, "valid": 1.0}
    assert utils.process_toolcall(doc, [f" {other}"]) == {"exact_match": 0.0, "valid": 1.0}
    assert utils.process_toolcall(doc, [doc["target"][:-2]]) == {"exact_match": 0.0, "valid": 0.0}
    assert utils.process_toolcall(doc, ["def f(x):"]) == {"exact_match": 0.0, "valid": 0.0}


def test_lm_eval_results_are_read_with_intervals():
    res = le.read_results(DUMMY)
    assert set(res) == set(lt.TASKS)
    acc = res["ps_code_mc"]["acc"]
    assert acc["value"] == pytest.approx(2 / 3) and acc["stderr"] == pytest.approx(1 / 3)
    assert acc["ci95"] == pytest.approx([2 / 3 - 1.96 / 3, 2 / 3 + 1.96 / 3])
    assert res["ps_code_ppl"]["bits_per_byte"]["ci95"] is None  # lm-eval reports "N/A"
    filled = le.fill_intervals(res, DUMMY)
    bpb = filled["ps_code_ppl"]["bits_per_byte"]
    rows = np.array([r["bits_per_byte"] for r in le.read_samples(DUMMY, "ps_code_ppl").values()], float)
    assert bpb["value"] == pytest.approx(-rows[:, 0].sum() / rows[:, 1].sum() / math.log(2))
    assert bpb["interval"] == "bootstrap" and bpb["ci95"][0] <= bpb["value"] <= bpb["ci95"][1]
    with pytest.raises(FileNotFoundError):
        le.read_results(DATA / "nowhere")


def test_paired_differences():
    mc = le.read_samples(DUMMY, "ps_code_mc")
    same = le.paired_differences(mc, mc, "ps_code_mc")
    assert same["acc"] == {"diff": 0.0, "ci95": [0.0, 0.0], "docs": 3}
    flipped = {d: {"acc": 1.0 - r["acc"], "acc_norm": r["acc_norm"]} for d, r in mc.items()}
    diff = le.paired_differences(mc, flipped, "ps_code_mc")["acc"]
    assert diff["diff"] == pytest.approx(np.mean([1 - 2 * r["acc"] for r in mc.values()]))
    ppl = le.read_samples(DUMMY, "ps_code_ppl")
    worse = {d: {m: [2 * v[0], v[1]] for m, v in r.items()} for d, r in ppl.items()}  # twice the nats per byte
    bpb = le.paired_differences(ppl, worse, "ps_code_ppl")
    assert set(bpb) == {"bits_per_byte"}
    rows = np.array([r["bits_per_byte"] for r in ppl.values()], float)
    assert bpb["bits_per_byte"]["diff"] == pytest.approx(-rows[:, 0].sum() / rows[:, 1].sum() / math.log(2))


def test_lm_eval_command_and_report(tmp_path):
    spec = le.LmEvalSpec(limit=5)
    argv = le.lm_eval_command("/x/lm_eval", spec, "http://127.0.0.1:9", ["ps_toolcalls"], True, Path("o"))
    args = dict(a.split("=", 1) for a in argv[argv.index("--model_args") + 1].split(","))
    assert argv[:4] == ["/x/lm_eval", "run", "--model", "local-completions"]
    assert args["base_url"] == "http://127.0.0.1:9/v1/completions" and args["add_bos_token"] == "True"
    assert args["tokenizer"] == "models/default" and args["max_length"] == "1024"
    assert argv[-2:] == ["--limit", "5"] and "--log_samples" in argv
    tasks = le.fill_intervals(le.read_results(DUMMY), DUMMY)
    rep = {"server_overrides": ["quant=bf16"], "server_command": "python -m phaseserve.server quant=bf16",
           "commands": ["lm_eval run ..."], "tasks": tasks, "compiles_during_eval": 0}
    results = {"date": "today", "settings": spec.__dict__, "tools": {"lm_eval": "/x/lm_eval"},
               "environment": {"date": "today"}, "representations": {"bf16": rep, "fp8_kv": rep},
               "comparisons": [{"reference": "bf16", "test": "fp8_kv", "differences": {
                   "ps_code_mc": le.paired_differences(le.read_samples(DUMMY, "ps_code_mc"),
                                                       le.read_samples(DUMMY, "ps_code_mc"), "ps_code_mc")}}]}
    md = le.markdown(results)
    assert "| bf16 | `quant=bf16` | 0.000 [0.000, 0.000]" in md and "0.667 [0.013, 1.320]" in md
    assert "| fp8_kv vs bf16 |" in md and "+0.0000 [+0.0000, +0.0000]" in md
    assert "`python -m phaseserve.server quant=bf16`" in md
    assert le.plot(tmp_path / "scores.png", results).stat().st_size > 0


def test_lm_eval_experiment_config_validates():
    cfg = OmegaConf.load(Path(__file__).parents[2] / "configs/experiment/lm_eval.yaml")
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(le.LmEvalSpec), cfg.experiment))
    assert spec.representations["fp8_kv"] == ["quant=fp8_kv"] and [*spec.bos_tasks, *spec.plain_tasks] == [*lt.TASKS]
    assert all(a in spec.representations and b in spec.representations for a, b in spec.comparisons)


def test_guidellm_report_is_read(tmp_path):
    rows = gs.read_report(DATA / "guidellm_report.json")
    assert [r["streams"] for r in rows] == [1, 4]
    r = rows[1]
    assert (r["successful"], r["errored"]) == (8, 0)
    assert r["duration_s"] == pytest.approx(17.229689598083496)
    assert r["output_tok_per_s"] == pytest.approx(512 / 17.229689598083496)
    assert r["ttft_ms"]["p95"] == pytest.approx(10740.998268127441)
    assert r["goodput_rps"] == pytest.approx(0.5 * 8 / 17.229689598083496)
    spec = gs.GuidellmSpec(representations={"bf16": ["quant=bf16"]}, streams=[1, 4])
    scen = gs.scenario(spec, "http://127.0.0.1:9", tmp_path / "g.json")
    assert scen["spec"]["profile"] == {"kind": "concurrent", "streams": [1, 4]}
    assert scen["spec"]["tokenizer"]["model"] == "models/default"
    assert scen["spec"]["metrics"]["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0}
    results = {"date": "today", "settings": spec.__dict__, "tools": {"guidellm": "/x/guidellm"},
               "environment": {"date": "today"},
               "representations": {"bf16": {"server_command": "python -m phaseserve.server quant=bf16",
                                            "command": "guidellm run --scenario s.json", "levels": rows,
                                            "compiles_before_sweep": 62, "compiles_in_warmup_run": 7,
                                            "compiles_during_sweep": 9}}}
    md = gs.markdown(results)
    assert "| bf16 | 4 | 8 / 0 | 0.46 | 30 | 42.3 | 10741 |" in md and "| bf16 | 62 | 7 | 9 |" in md
    assert all(p.stat().st_size > 0 for p in gs.plots(tmp_path, results))


def test_compile_count_and_tool_errors(tmp_path):
    log = "Finished tracing x\nCompiling jit(f) with global shapes\nCompiling jit(g) with global shapes\nINFO ok\n"
    assert count_compiles(log) == 2
    with pytest.raises(ToolError, match="not found"):
        run_tool([str(tmp_path / "no_such_tool")], tmp_path / "log", 10)
    with pytest.raises(ToolError, match="exited with 3"):
        run_tool([shutil.which("python3") or "python3", "-c", "import sys; sys.exit(3)"], tmp_path / "log", 10)
