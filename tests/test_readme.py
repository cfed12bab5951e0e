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
