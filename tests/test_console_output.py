"""What a newcomer sees on the terminal: two lines per evaluation by default (success, and what the policy did on
the first task), the table of sample conversations when asked, and help text whose paragraphs rich wraps itself."""

from __future__ import annotations

import functools
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.conftest import SMALL_RUN
from tether.cli import app
from tether.config import load_config
from tether.pipeline import build
from tether.pipeline.progress import Progress, show_eval
from tether.pipeline.trainer import train
from tether.pipeline.validation import read_validation
from tether.types import Task, Trajectory

WIDTH = 80


def call(name: str, arguments: dict) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_short_form_is_the_headline_and_the_first_tasks_actions():
    out = io.StringIO()
    tasks = [Task("t1", "eval", "refund"), Task("t2", "eval", "inventory")]
    solved = Trajectory("t1", [1], reward=1.0, success=True, termination="user_issue_resolved", messages=[
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Refund O-1, it arrived damaged."},
        {"role": "assistant", "content": "", "tool_calls": [call("check_refund_policy", {"order_id": "O-1"})]},
        {"role": "tool", "content": '{"approved": true}'},
        {"role": "assistant", "content": "Approved."}])
    failed = Trajectory("t2", [1], reward=0.0, termination="no_action",
                        messages=[{"role": "assistant", "content": ""}])
    metrics = {"eval/success_rate": 0.5, "eval/reward_mean": 0.5}
    show_eval(Console(file=out, width=120), "step 8", metrics, tasks, [solved, failed])
    show_eval(Console(file=out, width=WIDTH), "step 8", metrics, tasks, [solved, failed])
    assert out.getvalue().splitlines() == [
        "eval @ step 8: success 50.0% (1/2), reward 0.500",
        '  e.g. t1 (refund) ✓ 1.00, user_issue_resolved: check_refund_policy({"order_id": "O-1"}) → "Approved."',
        "eval @ step 8: success 50.0% (1/2), reward 0.500",
        '  e.g. t1 (refund) ✓ 1.00, user_issue_resolved: check_refund_policy({"order_id"…',  # cut at the width
    ]


@pytest.fixture
def console_of_a_run(tiny_model, tmp_path, monkeypatch):
    """``console_of_a_run(samples)``: what a 2-step SMALL_RUN evaluated at steps 0, 1 and 2 prints (the progress
    display on an 80-column console, ``samples`` as ``Progress`` takes it), and its run directory."""
    cfg_path = tmp_path / "small.yaml"
    cfg_path.write_text(SMALL_RUN)

    def run(samples: int | None) -> tuple[list[str], object]:
        out = io.StringIO()
        extra = {} if samples is None else {"samples": samples}
        monkeypatch.setattr(build, "Progress", functools.partial(Progress, console=Console(file=out, width=WIDTH),
                                                                 **extra))
        cfg = load_config([cfg_path], [f"model.path={tiny_model}", "trainer.total_steps=2", "trainer.eval_every=1"])
        run_dir = tmp_path / f"run-{samples}"
        train(cfg, run_dir)  # show_progress: the default, as `tether train` runs
        return out.getvalue().splitlines(), run_dir

    return run


def test_an_evaluation_prints_two_lines_by_default(console_of_a_run):
    lines, run_dir = console_of_a_run(None)
    evals = [i for i, line in enumerate(lines) if line.startswith("eval @ step")]
    assert [lines[i].split(":")[0] for i in evals] == ["eval @ step 0", "eval @ step 1", "eval @ step 2"]
    assert all(lines[i + 1].startswith("  e.g. test_000 ") and len(lines[i + 1]) <= WIDTH for i in evals)
    assert not any("┃" in line or "│" in line for line in lines)  # no table
    # the description of the run, 2 lines per evaluation, the bar's last state; nothing else but warnings
    assert len([line for line in lines if not line.startswith("warning:")]) <= 1 + 2 * 3 + 1, "\n".join(lines)
    # every conversation still reaches the run directory
    assert [len(read_validation(run_dir, s)) for s in (0, 1, 2)] == [4, 4, 4]


def test_the_table_of_sample_conversations_when_asked(console_of_a_run):
    lines, run_dir = console_of_a_run(2)
    text = "\n".join(lines)
    assert text.count("┏") == 3  # one table per evaluation
    assert "test_000" in text and "test_001" in text and "test_002" not in text  # its first 2 conversations
    system = json.loads((run_dir / "validation" / "step_0.jsonl").read_text().splitlines()[0])["messages"][0]
    assert system["role"] == "system" and system["content"].split()[0] not in text  # without the system prompt


runner = CliRunner()


@pytest.mark.parametrize("args", [[], ["verify"]])
def test_each_command_is_one_line_in_the_command_list_of_an_80_column_terminal(args):
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80"})  # a default terminal
    assert result.exit_code == 0, result.output
    rows = [row for row in result.output.split("Commands")[1].splitlines() if row.startswith("│")]
    assert rows and all(row.rstrip(" │").endswith(".") for row in rows), "\n".join(rows)


def test_help_paragraphs_are_wrapped_by_rich_not_by_the_source():
    text = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "the last complete checkpoint and the resume command are printed, the traceback appended" in text
    help_text = runner.invoke(app, ["verify", "optim", "--help"], env={"COLUMNS": "200"}).output
    assert "reward std > 0.1 (measured before the degenerate-group filter" in help_text
