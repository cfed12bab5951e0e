"""README.md's Python quickstart, extracted from the README as it is and run (on the test session's tiny model,
so that the tiny-sft preset need not be built)."""

import re
from pathlib import Path

import tether.config

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> str:
    """The first ```python block under "## Quickstart"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert blocks, "README.md's Quickstart has no ```python block"
    return blocks[0]


def test_the_quickstart_is_python_that_runs(tiny_model, monkeypatch, capsys):
    code = quickstart()
    compile(code, "README.md (Quickstart)", "exec")  # a stray line in the block fails here, naming it
    load = tether.config.load_config
    monkeypatch.setattr(tether.config, "load_config", lambda files, overrides=(): load(
        files, [*overrides, "model.preset=null", f"model.path={tiny_model}"]))
    monkeypatch.chdir(ROOT)  # the block names examples/… from the repository root
    exec(compile(code, "README.md (Quickstart)", "exec"), {"__name__": "quickstart"})
    printed = capsys.readouterr().out
    assert printed.startswith("[") and "{" in printed  # the 8 rewards, then the first one's breakdown


def readme_commands() -> list[str]:
    """Every ``tether …`` command line README.md shows: in backticks, and on the lines of its code blocks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    inline = re.findall(r"`(tether [^`]+)`", text)
    blocks = [line.strip() for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
              for line in block.splitlines() if line.strip().startswith("tether ")]
    return list(dict.fromkeys(c.split("#")[0].strip() for c in inline + blocks))


def test_every_tether_command_in_the_readme_names_a_command_and_flags_it_accepts():
    """Each README command resolves to a subcommand of the real CLI, and each ``--flag`` it shows is one of that
    subcommand's options (what its ``--help`` lists); placeholders (FILE…, CHECKPOINT) are not checked."""
    import typer.main

    from tether.cli import app

    root = typer.main.get_command(app)  # typer's own click: groups are the commands with subcommands
    commands = readme_commands()
    assert len(commands) >= 10, commands  # the README shows the CLI: if this finds few, the extraction broke
    for line in commands:
        words = line.replace("[", " ").replace("]", " ").replace("|", " ").split()[1:]
        cmd = root
        while words and getattr(cmd, "commands", None) and words[0] in cmd.commands:
            cmd, words = cmd.commands[words[0]], words[1:]
        assert not getattr(cmd, "commands", None), f"README: `{line}` names no subcommand of tether"
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        unknown = [f for f in flags if f not in known]
        assert not unknown, f"README: `{line}`: tether {cmd.name} has no {unknown} (it has {sorted(known)})"
