"""Prompt templates of the model rewards: text with ``{prompt}``, ``{completion}`` and
``{reference}`` placeholders (``{{`` and ``}}`` for literal braces), checked when the
config is read and filled without running anything (:meth:`str.format` with plain
names only: no attribute access, no indexing)."""

from __future__ import annotations

import string

PLACEHOLDERS = ("prompt", "completion", "reference")


def placeholders(template: str) -> list[str]:
    """The placeholder names of ``template``, in order; ``ValueError`` when it is not a
    valid template."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:  # an unmatched brace
        raise ValueError(f"not a valid template ({exc}); write {{{{ and }}}} for literal "
                         "braces") from None
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conversion:
            raise ValueError(
                f"{{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} is not a placeholder; use "
                + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
                + " (write {{ and }} for literal braces)")
        names.append(name)
    return names


def check_template(template: str) -> str:
    """``template`` when it is valid and names ``{completion}``; else ``ValueError``."""
    if "completion" not in placeholders(template):
        raise ValueError("the template must contain {completion}")
    return template


def render(template: str, **values: str) -> str:
    """``template`` with its placeholders filled from ``values``."""
    return template.format_map({name: values.get(name, "") for name in PLACEHOLDERS})


__all__ = ["PLACEHOLDERS", "check_template", "placeholders", "render"]
