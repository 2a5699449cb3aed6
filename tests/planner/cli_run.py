"""Run `pdserve` sub-commands in-process through the real entry point."""

from __future__ import annotations

from pdserve.cli import main


def run_pdserve(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `pdserve ARGV`."""
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err
