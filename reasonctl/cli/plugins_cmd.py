"""``reasonctl plugins``: installed plugins, their components, and what cannot be used.

The listing goes to stdout (it is the command's output; errors of the command itself go to
stderr). ``--json`` prints :meth:`~reasonctl.core.plugins.PluginHost.describe` as it is.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from reasonctl.cli import common
from reasonctl.cli.common import handle_errors

STATUS_STYLE = {"ok": "[green]ok[/]", "error": "[red]error[/]", "disabled": "[yellow]disabled[/]"}
MARKS = {"conflict": " [red](conflict)[/]", "broken": " [red](broken)[/]",
         "shadowed": " [yellow](not used: built-in name)[/]", "ok": ""}


@handle_errors
def plugins_command(
    as_json: Annotated[
        bool, typer.Option("--json", help="Machine-readable output (everything --all shows).")
    ] = False,
    show_all: Annotated[
        bool,
        typer.Option("--all", help="Also show hooks, descriptions, config keys and the "
                                   "tracebacks of plugins that failed to load."),
    ] = False,
) -> None:
    """List installed plugins, their components, name conflicts and load errors."""
    report = common.host().describe()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    out = Console(soft_wrap=True, highlight=False)
    for line in render_report(report, show_all=show_all):
        out.print(line)


def render_report(report: dict[str, Any], *, show_all: bool) -> list[str]:
    """The text listing (rich markup; user-supplied text escaped) of a describe() report."""
    entries = {(c["plugin"], kind, c["name"]): c
               for kind, items in report["components"].items() for c in items}
    lines: list[str] = []
    for plugin in report["plugins"]:
        owner = (f"{plugin['distribution']} {plugin['version']}" if plugin["distribution"]
                 else "ad-hoc")
        lines.append(f"[bold]{escape(plugin['name'])}[/] ({escape(owner)}): "
                     f"{STATUS_STYLE.get(plugin['status'], plugin['status'])}")
        if plugin["error"]:
            lines.append(f"  [red]{escape(plugin['error'])}[/]")
        if show_all and plugin["hooks"]:
            lines.append(f"  hooks: {', '.join(plugin['hooks'])}")
        for kind, names in plugin["components"].items():
            entries_of_kind = [entries[(plugin["name"], kind, name)] for name in names]
            if show_all:
                lines += [line for entry in entries_of_kind
                          for line in _component_lines(kind, entry)]
            else:
                shown = ", ".join(escape(e["name"]) + MARKS[e["status"]] for e in entries_of_kind)
                lines.append(f"  {kind.replace('_', ' ')}: {shown}")
        if plugin["commands"]:
            lines.append(f"  commands: {escape(', '.join(plugin['commands']))}")
    if report["conflicts"]:
        lines += ["", "[red]Name conflicts[/] (none of the registrations is used):"]
        lines += [f"  {escape(conflict['message'])}" for conflict in report["conflicts"]]
    if report["shadowed"]:
        lines += ["", "[yellow]Built-in names[/] (these registrations are not used):"]
        lines += [f"  {escape(shadow['message'])}" for shadow in report["shadowed"]]
    if report["broken"]:
        lines += ["", "[red]Unusable components[/] (their factories cannot be called):"]
        lines += [f"  {escape(b['kind'].replace('_', ' '))} {escape(repr(b['name']))} "
                  f"({escape(b['plugin'])}): {escape(b['problem'])}" for b in report["broken"]]
    failed = [p for p in report["plugins"] if p["status"] == "error"]
    if failed and show_all:
        for plugin in failed:
            lines += ["", f"[red]Traceback of {escape(plugin['name'])}:[/]",
                      escape((plugin["traceback"] or "").rstrip())]
    elif failed:
        lines += ["", "`reasonctl plugins --all` shows the tracebacks."]
    return lines


def _component_lines(kind: str, entry: dict[str, Any]) -> list[str]:
    """A component under ``--all``: kind, name and description, then one line per key."""
    head = f"  {kind.replace('_', ' ')} {escape(entry['name'])}{MARKS[entry['status']]}"
    if entry["description"]:
        head += f": {escape(entry['description'])}"
    lines = [head]
    if entry["problem"]:
        lines.append(f"      [red]{escape(entry['problem'])}[/]")
    for key in entry["config"]:
        default = "required" if key["required"] else f"= {json.dumps(key['default'])}"
        text = f"{key['key']}: {key['type']} {default}"
        if key["description"]:
            text += f"  {key['description']}"
        lines.append(f"      {escape(text)}")
    return lines
