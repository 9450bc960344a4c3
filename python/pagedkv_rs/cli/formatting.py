"""The help formatter every ``pagedkv`` command's parser uses."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default: appended unless the help text already says it, or the
    option is a flag, or its default is None (whose help text says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "(default" in help or "default:" in help or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return help
        return help + " (default: %(default)s)"
