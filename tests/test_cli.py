"""The pagedkv command's dispatch, --version and --help texts, and the benchmark commands' smoke runs (alloc, kernel,
linear)."""

from __future__ import annotations

import argparse
import importlib
import pydoc
import subprocess
import sys

import numpy as np
import pytest

import pagedkv_rs
from pagedkv_rs.cli import main as cli
from pagedkv_rs.cli.formatting import HelpFormatter


def test_help_and_unknown(capsys):
    assert cli.main(["--help"]) == 0
    assert "bench alloc" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_info(capsys):
    assert cli.main(["info"]) == 0
    assert "allocator backend" in capsys.readouterr().out


def test_bench_alloc_quick(capsys):
    assert cli.main(["bench", "alloc", "--quick", "--workload", "decode-step-256"]) == 0
    out = capsys.readouterr().out
    assert "decode-step-256" in out and " us" in out


def test_bench_kernel_tiny(capsys):
    prev = pagedkv_rs.get_isa()
    assert cli.main(["bench", "kernel", "--tiny", "--threads", "1"]) == 0
    assert pagedkv_rs.get_isa() == prev  # the forced-scalar rows put the setting back
    out = capsys.readouterr().out
    info = pagedkv_rs.kernel_info()
    assert f"kernel {info['active_isa']}, 1 threads" in out and "x numpy" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["A"], ["Long"], ["SmolLM2"], ["Prefill"], ["Verify"])
    ]
    assert [r[0] for r in rows] == ["A", "A", "Long", "SmolLM2", "SmolLM2", "Prefill", "Verify"]
    assert all(float(r[3]) > 0 and float(r[-1]) > 0 for r in rows)  # time ms and x numpy measured
    assert "memory read bandwidth over all 7 probes: median" in out  # one probe per config and round
    lo, hi = (float(x) for x in rows[0][7].split("-"))
    assert 0 < lo <= float(rows[0][6]) <= hi  # the median ratio lies in its rounds' range


def test_bench_kernel_rounds_pair_each_probe_with_a_timing(capsys):
    assert cli.main(["bench", "kernel", "--tiny", "--threads", "1", "--only", "A", "--rounds", "3", "--no-scalar"]) == 0
    out = capsys.readouterr().out
    assert "3 rounds of a memory-bandwidth probe" in out
    assert "memory read bandwidth over all 6 probes" in out  # A has two dtype rows
    with pytest.raises(SystemExit):
        cli.main(["bench", "kernel", "--tiny", "--rounds", "0"])


def test_bench_kernel_resident_times_decode_configs_only(capsys):
    args = ["bench", "kernel", "--tiny", "--threads", "1", "--only", "A,Prefill", "--rounds", "1", "--no-scalar"]
    assert cli.main([*args, "--no-numpy", "--resident"]) == 0
    out = capsys.readouterr().out
    assert "resident ms" in out and "overlap" in out
    rows = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if r[:1] in (["A"], ["Prefill"])}
    assert float(rows["A", "float16"][-2]) > 0 and float(rows["A", "float32"][-2]) > 0  # resident ms measured
    assert rows["Prefill", "float16"][-2] == "nan"  # prefill is compute-bound: no resident row


def test_bench_kernel_resident_table_keeps_shape_and_stays_in_range():
    from pagedkv_rs.cli.bench.kernel import CONFIGS, RESIDENT_BYTES, build, resident, tiny

    layers = build(tiny(CONFIGS[1]))
    for (q, k, _, tables, *_), (q2, k2, _, t2, *_) in zip(layers, resident(layers)):
        assert q2 is q and k2 is k and t2.shape == tables.shape and t2.dtype == np.int32
        n = max(1, RESIDENT_BYTES // (2 * k[0].nbytes))
        assert t2.min() >= 0 and t2.max() < n


def test_bench_linear_one_round(capsys):
    assert cli.main(["bench", "linear", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert f"linear ISA {pagedkv_rs.kernel_info()['linear_isa']}" in out
    assert "one decode step's matmuls" in out and "lm_head" in out


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pagedkv_rs {pagedkv_rs.__version__}"
    r = subprocess.run([sys.executable, "-m", "pagedkv_rs.cli.main", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"pagedkv_rs {pagedkv_rs.__version__}"


def test_bench_help_lists_the_programs(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    programs = [path[1] for path in cli.COMMANDS if path[0] == "bench"]
    assert all(f"\n  {p} " in out for p in programs), out
    assert cli.main(["bench"]) == 2


@pytest.mark.parametrize("path", list(cli.COMMANDS), ids=" ".join)
def test_every_help_shows_the_defaults(path, capsys):
    mod = importlib.import_module(cli.COMMANDS[path])
    parser = mod.build_parser()
    assert parser.formatter_class is HelpFormatter
    with pytest.raises(SystemExit) as e:
        cli.main([*path, "--help"])
    assert e.value.code == 0
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also after a hyphen
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{' '.join(path)} {action.option_strings[0]} has no help text"
        shown = parser._get_formatter()._get_help_string(action) % {"default": action.default}
        assert "(default" in shown or "default:" in shown, f"{' '.join(path)} {action.option_strings[0]}: {shown}"
        assert "".join(shown.split()) in out


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    from pagedkv_rs.cli import simulate

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate, "main", interrupted)
    assert cli.main(["simulate"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_help_of_the_package_lists_llm():
    text = pydoc.render_doc(pagedkv_rs, renderer=pydoc.plaintext)
    assert "class LLM(" in text and "LLM" in pagedkv_rs.__all__ and "LLM" in dir(pagedkv_rs)
    # without the model extra LLM is not listed, so `from pagedkv_rs import *` still works
    code = "import sys; sys.modules['gguf'] = None\nimport pagedkv_rs\nfrom pagedkv_rs import *\n"
    code += "print('LLM' in pagedkv_rs.__all__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip()) == (0, "False"), r.stderr


def test_type_checkers_see_llm(tmp_path):
    # The package is typed inline (py.typed; the lazy LLM is imported under TYPE_CHECKING) and only the
    # compiled core has a stub (_core.pyi), as pydantic-core does: mypy resolves pagedkv_rs.LLM to the class.
    code = "import pagedkv_rs\nreveal_type(pagedkv_rs.LLM)\nreveal_type(pagedkv_rs.LLM().generate)\n"
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-> pagedkv_rs.llm.LLM" in r.stdout and "list[pagedkv_rs.engine.request.RequestOutput]" in r.stdout
