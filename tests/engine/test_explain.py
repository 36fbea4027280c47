"""`explain`: one call with torch's structured compile trace captured, written as a folder."""

import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.cli import main
from magi_zoo.engine.observe.explain import explain_call


class Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        n = int(y.sum().item() > 0)  # BREAK_LINE: `.item()` is a graph break
        return y * 2 + n


def _break_line() -> int:
    import inspect

    src, first = inspect.getsourcelines(Breaks.forward)
    return first + next(i for i, ln in enumerate(src) if "BREAK_LINE" in ln)


def test_graph_break_with_users_file_line_and_a_fix(tmp_path):
    m = Breaks()
    report = magi_zoo.apply(m, {"": {"backend": "aot_eager"}}, gpu="cpu")
    ex = explain_call(m, {"x": torch.randn(2, 4)}, tmp_path, report=report)
    # one break -> two frames: forward up to the break, and dynamo's resume function after it
    assert len(ex.breaks) == 1 and len(ex.compiles) == 2
    b = ex.breaks[0]
    assert b.where == f"{__file__}:{_break_line()}" and b.function == "forward" and b.region == "<root>"
    assert "item()" in b.reason and "capture_scalar_outputs" in b.fix
    for name in ("summary.md", "graph_breaks.md", "recompiles.md", "events.jsonl", "report.txt",
                 "graph_breaks/01.txt"):
        assert (tmp_path / name).is_file(), name
    assert f"{__file__}:{_break_line()}" in (tmp_path / "summary.md").read_text()
    frames = sorted(p.name for p in (tmp_path / "regions" / "root").iterdir())
    assert frames[0] == "0_0_forward" and frames[1].startswith("1_0_torch_dynamo_resume_in_forward")
    for f in frames:
        d = tmp_path / "regions" / "root" / f
        assert "lin" in (d / "dynamo_graph.py").read_text() or f != "0_0_forward"
        assert (d / "guards.txt").stat().st_size > 0 and (d / "aot_graph.py").is_file()


def test_explain_wan_tiny_from_the_cli(tmp_path, capsys):
    # inductor on CPU: the generated code is part of what explain shows
    assert main(["explain", "wan2.1-tiny", "--gpu", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "summary.md" in out
    summary = (tmp_path / "summary.md").read_text()
    # 4 blocks, one compiled frame: the blocks share code (fullgraph=True: no breaks)
    assert "1 frame compile(s), 0 graph break(s), 0 recompile(s)" in summary
    d = tmp_path / "regions" / "WanTransformerBlock" / "0_0_forward"
    for name in ("dynamo_graph.py", "aot_graph.py", "post_grad_graph.py", "output_code.py", "guards.txt",
                 "metrics.json"):
        assert (d / name).is_file(), name
    assert "def call" in (d / "output_code.py").read_text()  # inductor's generated wrapper


def test_explain_refuses_a_file_as_out(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(["explain", "wan2.1-tiny", "--gpu", "cpu", "--out", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err
