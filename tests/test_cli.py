"""The pagedkv command's dispatch and the allocator benchmark's smoke run."""

from __future__ import annotations

from pagedkv_rs.cli import main as cli


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
