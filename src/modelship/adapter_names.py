"""The names a LoRA adapter may be served under, one rule for every place that takes one.

A name travels as `--lora NAME=PATH` to every replica the fleet starts (split at the first
`=`), as a request's `model`, and as a metric label: letters, digits, `.`, `_` and `-`, at
most 64 of them. The gateway, the replica's admin route, `serve --lora` and `serve.loras`
all check it here.
"""

from __future__ import annotations

import re

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
ADAPTER_NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-'"


def is_adapter_name(name: object) -> bool:
    return isinstance(name, str) and re.fullmatch(ADAPTER_NAME_PATTERN, name) is not None
