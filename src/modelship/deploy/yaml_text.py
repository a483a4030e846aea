"""YAML text of rendered objects, as a person would write it by hand.

PyYAML writes an object referenced twice (one verbs list shared by several RBAC rules) as
an anchor and aliases (`verbs: &id001`, `verbs: *id001`). kubectl reads them, but a reader
of the file, `grep` and some tools (kustomize patches, yq edits of one rule) do not expect
them, so every rendered file is written with aliases off: each value spelled in full.
"""

from __future__ import annotations

from typing import Any

import yaml


class PlainDumper(yaml.SafeDumper):
    """SafeDumper that never writes an anchor or alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    """One YAML document, keys in insertion order, no anchors."""
    return yaml.dump(data, Dumper=PlainDumper, sort_keys=False, default_flow_style=False)


def dump_yaml_all(documents: list[Any]) -> str:
    """Several YAML documents separated by `---`, keys in insertion order, no anchors."""
    return yaml.dump_all(documents, Dumper=PlainDumper, sort_keys=False, default_flow_style=False)
