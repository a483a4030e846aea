"""Kubernetes resource quantities (`500m`, `8Gi`, `1e3`) parsed to exact numbers.

The API server rejects a manifest whose quantity does not parse, and it refuses a pod whose
limit is below its request; both are checked offline here, so the parser must follow the
API's grammar exactly: a signed decimal number, then one suffix (binary `Ki`..`Ei`, decimal
`n u m k M G T P E`, or a decimal exponent `e3`/`E-2`).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
# number: digits with an optional fraction (or a bare fraction); suffix: as the docstring says.
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message quotes the value and shows valid forms."""


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a quantity (`"500m"` -> 0.5, `"2Gi"` -> 2147483648)."""
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(
            f"{text!r} is not a Kubernetes quantity (examples: 500m, 2, 8Gi, 1.5G, 1e3)"
        )
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        raise QuantityError(f"{text!r}: bad number") from None
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * Decimal(10) ** int(suffix[1:])
