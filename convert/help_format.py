"""argparse help that states each flag's default (the converter's and the planner's `--help`)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Append "(default: X)" to a flag's help where X says something: not for on/off switches (off unless given)
    or flags without a default (their help says what happens then)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or isinstance(action, argparse._StoreConstAction):
            return action.help
        return super()._get_help_string(action)
